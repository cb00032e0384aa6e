"""No harness module changes a vLLM class, module or object except ``harness/engine/patches.py``.

Code elsewhere sets an attribute on a vLLM object only through a helper of ``patches``
(``set_on``, ``take_from``, ``replaced_on``, ``swap_class``), and those helpers refuse a name that
``patches.PATCHES`` does not list. This test is the other half: an AST scan of every ``.py`` under
``harness/`` that fails on any other write to an attribute (``x.a = v``, ``x.a += v``, ``del x.a``,
``setattr``/``delattr``, ``object.__setattr__``, ``x.__setattr__``, ``x.__dict__[k] = v``,
``x.__dict__.update(...)``/``.pop(...)``, ``vars(x)[k] = v``, ``x.__class__ = C``) unless its target
is the harness's own object.

Which objects are the harness's own is read from the code, not from a list of names:

* ``self``/``cls`` in a method of a class of the repository's own packages (``harness``,
  ``policies``); a harness subclass of a vLLM class (the scheduler, a listed ``overridden`` patch)
  counts for the attributes its own code binds or declares only: ``self.kv_ledger.steps`` is the
  harness's, ``self.kv_cache_manager.x`` vLLM's;
* what harness code makes: a call of a harness class, a literal, a comprehension, or a value of a
  harness class by an annotation (a parameter's, a variable's, a class field's, a function's or
  method's return), followed through local names, loops, ``zip``/``enumerate``, ``dict.get``,
  subscripts and the attributes of such objects;
* what the harness put on a vLLM object through ``patches.set_on(obj, "name", value)``, read back
  (``obj.name``, ``obj.__dict__.get("name")``, ``getattr(obj, "name", None)``,
  ``patches.take_from(obj, "name")``): the runner's ``_kv_eviction`` is the harness's state.

Every other target is foreign. A foreign target fails the scan anywhere when it is reached from a
name imported from ``vllm`` (``SomeVllmClass.foo = bar``) or when the write is a meta-programming
form (``setattr``/``delattr`` with a computed name, ``__class__``, ``__dict__``, ``__setattr__``);
any foreign target fails in the engine room, where vLLM's objects are handled: ``harness/engine/``
and every module that imports ``vllm`` (``layer.forward = f`` there). Outside it a plain write to a
foreign object is to another library's (a pandas frame, a Hugging Face model) and passes.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "harness"
PATCHES_FILE = HARNESS / "engine" / "patches.py"
ENGINE_ROOM = HARNESS / "engine"
OWN_PACKAGES = ("harness", "policies")


# --- what the scan knows of a value ----------------------------------------------------------------

@dataclass(frozen=True)
class Own:
    """An instance of one of the harness's ``classes``; with none named, a value harness code made
    (a literal, a lambda, a number)."""
    classes: frozenset = frozenset()


@dataclass(frozen=True)
class ClassRef:
    """A harness class itself."""
    name: str


@dataclass(frozen=True)
class Function:
    """A harness function, by what its annotation says it returns."""
    returns: object


@dataclass(frozen=True)
class Box:
    """A container the harness made: ``seq`` iterates its elements, ``map`` is looked up by key."""
    kind: str
    element: object


@dataclass(frozen=True)
class Tup:
    items: tuple


class Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


FOREIGN = Marker("foreign")  # not known to be the harness's
VLLM = Marker("vllm")        # reached from a name imported from vllm
NONE = Marker("none")        # None (or nothing bound yet): neutral in a join, never a write's target
OWN = Own()
OWNED = (Own, ClassRef, Function)


def join(a, b):
    if a is NONE:
        return b
    if b is NONE or a == b:
        return a
    if a is VLLM or b is VLLM:
        return VLLM
    if isinstance(a, Own) and isinstance(b, Own):
        return Own(a.classes | b.classes) if a.classes and b.classes else OWN
    if isinstance(a, Box) and isinstance(b, Box) and a.kind == b.kind:
        return Box(a.kind, join(a.element, b.element))
    if isinstance(a, Tup) and isinstance(b, Tup) and len(a.items) == len(b.items):
        return Tup(tuple(join(x, y) for x, y in zip(a.items, b.items)))
    if isinstance(a, (Tup, Box)) and isinstance(b, (Tup, Box)):
        return Box("seq", join(element_of(a), element_of(b)))
    return FOREIGN


def join_all(values):
    result = NONE
    for value in values:
        result = join(result, value)
    return result


def element_of(value):
    """What iterating ``value`` gives."""
    if isinstance(value, Box):
        return value.element if value.kind == "seq" else FOREIGN  # a map's keys
    if isinstance(value, Tup):
        return join_all(value.items)
    return VLLM if value is VLLM else FOREIGN


# --- the repository's own classes and functions -------------------------------------------------------

@dataclass
class ClassInfo:
    node: ast.ClassDef
    bases: list
    declared: dict   # attribute -> type its annotation states (class body, ``self.x: T = ...``, properties)
    bound: dict      # attribute -> join of what ``self.x = ...`` binds in its methods
    returns: dict    # method -> annotated return type


class Program:
    """The repository's own classes and functions, and every harness module's scopes, solved
    together (a class's attributes are typed by what its methods bind)."""

    def __init__(self, sources: dict[Path, str]):
        self.trees = {path: ast.parse(source, filename=str(path)) for path, source in sources.items()}
        self.classes: dict[str, ClassInfo] = {}
        function_nodes: dict[str, list] = {}
        for tree in self.trees.values():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] = ClassInfo(node, [ast.unparse(b).split(".")[-1] for b in node.bases],
                                                        {}, {}, {})
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    function_nodes.setdefault(node.name, []).append(node)
        self.functions = {name: join_all(self.annotation(node.returns) for node in nodes)
                          for name, nodes in function_nodes.items()}
        for info in self.classes.values():
            for node in info.node.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    info.declared[node.target.id] = self.annotation(node.annotation)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if any(ast.unparse(d).split(".")[-1] in ("property", "cached_property") for d in node.decorator_list):
                        info.declared[node.name] = self.annotation(node.returns)
                    else:
                        info.returns[node.name] = self.annotation(node.returns)
        self.added: dict[str, object] = {}  # attribute set on vLLM objects by patches.set_on -> what it holds
        self.modules = {path: Module(self, path, tree) for path, tree in self.trees.items()}
        for _ in range(12):
            before = ({name: dict(info.bound) for name, info in self.classes.items()}, dict(self.added))
            for module in self.modules.values():
                module.solve()
            for info in self.classes.values():
                info.bound = {}
            self.added = {}
            for module in self.modules.values():
                module.bind_class_attributes()
                module.bind_added_attributes()
            if before == ({name: dict(info.bound) for name, info in self.classes.items()}, self.added):
                break

    def annotation(self, node):
        """The type an annotation states, as far as the harness's own classes go."""
        if node is None:
            return FOREIGN
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return FOREIGN
        if isinstance(node, ast.Constant) and node.value is None:
            return NONE
        if isinstance(node, ast.Name):
            return Own(frozenset({node.id})) if node.id in self.classes else FOREIGN
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return join(self.annotation(node.left), self.annotation(node.right))
        if isinstance(node, ast.Subscript):
            outer = ast.unparse(node.value).split(".")[-1]
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            args = [arg for arg in args if not (isinstance(arg, ast.Constant) and arg.value is Ellipsis)]
            if outer in ("Optional", "Union"):
                return join_all(self.annotation(arg) for arg in args)
            if outer in ("dict", "Dict", "OrderedDict", "Mapping", "MutableMapping", "defaultdict"):
                return Box("map", self.annotation(args[-1]))
            if outer in ("list", "List", "tuple", "Tuple", "set", "Set", "frozenset", "Sequence", "Iterable",
                         "Iterator", "deque", "MutableSequence"):
                element = join_all(self.annotation(arg) for arg in args)
                return Box("seq", FOREIGN if element is NONE else element)
        return FOREIGN

    def attribute(self, classes, name: str):
        value = join_all(self._lookup(cls, name, set()) for cls in classes)
        return FOREIGN if value is NONE else value

    def method_return(self, classes, name: str):
        value = join_all(self._lookup(cls, name, set(), "returns") for cls in classes)
        return FOREIGN if value is NONE else value

    def _lookup(self, cls: str, name: str, seen: set, table: str = "attributes"):
        info = self.classes.get(cls)
        if info is None or cls in seen:
            return FOREIGN
        seen.add(cls)
        if table == "returns":
            if name in info.returns:
                return info.returns[name]
        elif name in info.declared:
            return info.declared[name]
        elif name in info.bound:
            return info.bound[name]
        for base in info.bases:
            if base in self.classes:
                found = self._lookup(base, name, seen, table)
                if found is not FOREIGN:
                    return found
        return FOREIGN  # not the harness's to say: a vLLM base's attribute, or unknown

    def writes(self) -> list["Write"]:
        return [write for module in self.modules.values() for write in module.writes()]


# --- one module --------------------------------------------------------------------------------

META_CALLS = {"setattr", "delattr"}
DICT_WRITES = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}
CONTAINERS = {"list", "tuple", "sorted", "reversed", "set", "frozenset", "iter"}
EMPTY_CONTAINERS = {"dict": "map", "OrderedDict": "map", "defaultdict": "map", "list": "seq", "set": "seq",
                    "deque": "seq", "tuple": "seq"}
COPIES = {"copy", "deepcopy", "replace"}  # copy.copy, copy.deepcopy, dataclasses.replace: the argument's kind


@dataclass(frozen=True)
class Write:
    path: Path
    line: int
    text: str
    target: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_absolute() else self.path}:{self.line}: " \
               f"{self.text}    [target: {self.target}]"


class Scope:
    """A function (or lambda, class body, module top level): its names and what binds them."""

    def __init__(self, node, parent: "Scope | None", method_of: str | None = None):
        self.node, self.parent, self.method_of = node, parent, method_of
        self.fixed: dict[str, object] = {}     # parameters and imports
        self.bindings: list[tuple] = []        # (target, source, how): how is value, element or type
        self.names: dict[str, object] = {}

    def lookup(self, name: str, program: Program):
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        if name in program.classes:
            return ClassRef(name)
        return FOREIGN


class Module:
    def __init__(self, program: Program, path: Path, tree: ast.Module):
        self.program, self.path, self.tree = program, path, tree
        self.imports_vllm = any(
            isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "vllm" for alias in node.names)
            or isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm"
            for node in ast.walk(tree))
        self.engine_room = path.is_relative_to(ENGINE_ROOM) or self.imports_vllm
        self.scopes: list[Scope] = []
        self._open(tree, None, None)

    # scopes

    def _open(self, node, parent: Scope | None, method_of: str | None) -> Scope:
        scope = Scope(node, parent, method_of)
        self.scopes.append(scope)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            positional = node.args.posonlyargs + node.args.args
            decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            for index, arg in enumerate(positional + node.args.kwonlyargs):
                if index == 0 and method_of is not None and arg in positional and "staticmethod" not in decorators:
                    scope.fixed[arg.arg] = ClassRef(method_of) if "classmethod" in decorators \
                        else Own(frozenset({method_of}))
                else:
                    scope.fixed[arg.arg] = self.program.annotation(arg.annotation) if arg.annotation else FOREIGN
            for arg in (node.args.vararg, node.args.kwarg):
                if arg is not None:
                    scope.fixed[arg.arg] = FOREIGN
        body = node.body if isinstance(node.body, list) else [node.body]
        for child in body:
            self._collect(child, scope)
        return scope

    def _collect(self, node, scope: Scope) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.bindings.append((ast.Name(node.name), Function(self.program.annotation(node.returns)), "type"))
            for part in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d]:
                self._collect(part, scope)
            class_body = isinstance(scope.node, ast.ClassDef)
            # a method's names skip its class body (Python's scoping)
            self._open(node, scope.parent if class_body else scope, scope.node.name if class_body else None)
            return
        if isinstance(node, ast.Lambda):
            self._open(node, scope, None)
            return
        if isinstance(node, ast.ClassDef):
            scope.bindings.append((ast.Name(node.name), ClassRef(node.name), "type"))
            for part in node.bases + node.decorator_list:
                self._collect(part, scope)
            self._open(node, scope, None)
            return
        if isinstance(node, ast.Assign):
            for target in node.targets:
                scope.bindings.append((target, node.value, "value"))
        elif isinstance(node, ast.AnnAssign):
            declared = self.program.annotation(node.annotation)
            if isinstance(declared, (Own, Box)):
                scope.bindings.append((node.target, declared, "type"))
            elif node.value is not None:
                scope.bindings.append((node.target, node.value, "value"))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            # (a comprehension's names are bound here, in its enclosing scope: a join, never less strict)
            scope.bindings.append((node.target, node.iter, "element"))
        elif isinstance(node, ast.NamedExpr):
            scope.bindings.append((node.target, node.value, "value"))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    scope.bindings.append((item.optional_vars, FOREIGN, "type"))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.bindings.append((ast.Name(node.name), FOREIGN, "type"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                scope.fixed[bound] = self._imported(node, alias)
        for child in ast.iter_child_nodes(node):
            self._collect(child, scope)

    def _imported(self, node, alias):
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        if isinstance(node, ast.ImportFrom) and not node.level and module.split(".")[0] == "vllm" \
                or isinstance(node, ast.Import) and module.split(".")[0] == "vllm":
            return VLLM
        if isinstance(node, ast.ImportFrom) and (node.level or module.split(".")[0] in OWN_PACKAGES):
            if alias.name in self.program.classes:
                return ClassRef(alias.name)
            if alias.name in self.program.functions:
                return Function(self.program.functions[alias.name])
        return FOREIGN

    def solve(self) -> None:
        for _ in range(12):
            changed = False
            for scope in self.scopes:
                bound: dict[str, object] = {}
                for target, source, how in scope.bindings:
                    if how == "value":
                        kind = self.kind(source, scope)
                    elif how == "element":
                        kind = element_of(self.kind(source, scope))
                    else:
                        kind = source
                    for leaf, leaf_kind in self._leaves(target, kind):
                        if isinstance(leaf, ast.Name):
                            bound[leaf.id] = join(bound.get(leaf.id, NONE), leaf_kind)
                names = dict(scope.fixed)
                for name, kind in bound.items():
                    names[name] = join(names[name], kind) if name in names else kind
                if names != scope.names:
                    scope.names, changed = names, True
            if not changed:
                return

    def bind_class_attributes(self) -> None:
        """``x = v`` in a class body, and ``self.x = v`` (or ``self.x: T = v``) in a method, type
        attribute ``x`` of the class."""
        for scope in self.scopes:
            if isinstance(scope.node, ast.ClassDef) and scope.node.name in self.program.classes \
                    and self.program.classes[scope.node.name].node is scope.node:
                info = self.program.classes[scope.node.name]
                for name, kind in scope.names.items():
                    if name not in scope.fixed:  # (an import in a class body is no attribute worth typing)
                        info.bound[name] = join(info.bound.get(name, NONE), kind)
            if scope.method_of is None or scope.method_of not in self.program.classes:
                continue
            info = self.program.classes[scope.method_of]
            positional = scope.node.args.posonlyargs + scope.node.args.args
            if not positional:
                continue
            me = positional[0].arg
            for inner in [scope] + [s for s in self.scopes if _inside(s, scope)]:
                for target, source, how in inner.bindings:
                    if how == "value":
                        kind = self.kind(source, inner)
                    elif how == "element":
                        kind = element_of(self.kind(source, inner))
                    else:
                        kind = source
                    for leaf, leaf_kind in self._leaves(target, kind):
                        if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                and leaf.value.id == me and inner.lookup(me, self.program) == Own(frozenset({scope.method_of})):
                            if how == "type" and isinstance(kind, (Own, Box)):
                                info.declared.setdefault(leaf.attr, kind)
                            info.bound[leaf.attr] = join(info.bound.get(leaf.attr, NONE), leaf_kind)

    def bind_added_attributes(self) -> None:
        """``patches.set_on(obj, "name", value)``: what attribute ``name`` of a vLLM object holds."""
        for scope in self.scopes:
            for node in _nodes_of(scope.node):
                name = _helper_name(node, "set_on")
                if name is not None and len(node.args) > 2:
                    self.program.added[name] = join(self.program.added.get(name, NONE),
                                                    self.kind(node.args[2], scope))

    def _leaves(self, target, kind):
        if isinstance(target, (ast.Tuple, ast.List)):
            plain = all(not isinstance(element, ast.Starred) for element in target.elts)
            for index, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    yield from self._leaves(element.value, Box("seq", element_of(kind)))
                elif plain and isinstance(kind, Tup) and len(kind.items) == len(target.elts):
                    yield from self._leaves(element, kind.items[index])
                else:
                    yield from self._leaves(element, element_of(kind))
        else:
            yield target, kind

    # what an expression is

    def kind(self, node, scope: Scope):
        program = self.program
        if isinstance(node, ast.Constant):
            return NONE if node.value is None else OWN
        if isinstance(node, ast.Name):
            return scope.lookup(node.id, program)
        if isinstance(node, (ast.JoinedStr, ast.Compare, ast.Lambda)):
            return OWN
        if isinstance(node, ast.NamedExpr):
            return self.kind(node.value, scope)
        if isinstance(node, ast.IfExp):
            return join(self.kind(node.body, scope), self.kind(node.orelse, scope))
        if isinstance(node, ast.BoolOp):
            return join_all(self.kind(value, scope) for value in node.values)
        if isinstance(node, ast.Tuple):
            return Tup(tuple(self.kind(element, scope) for element in node.elts))
        if isinstance(node, (ast.List, ast.Set)):
            return Box("seq", join_all(element_of(self.kind(item.value, scope)) if isinstance(item, ast.Starred)
                                       else self.kind(item, scope) for item in node.elts))
        if isinstance(node, ast.Dict):
            return Box("map", join_all(self.kind(value, scope) for value in node.values))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return Box("seq", self.kind(node.elt, scope))
        if isinstance(node, ast.DictComp):
            return Box("map", self.kind(node.value, scope))
        if isinstance(node, ast.Attribute):
            owner = self.kind(node.value, scope)
            if owner is VLLM:
                return VLLM
            if isinstance(owner, Own) and owner.classes:
                return program.attribute(owner.classes, node.attr)
            if isinstance(owner, ClassRef):
                return program.attribute({owner.name}, node.attr)
            return program.added.get(node.attr, FOREIGN)
        if isinstance(node, ast.Subscript):
            owner = self.kind(node.value, scope)
            if isinstance(node.slice, ast.Slice):
                return owner if isinstance(owner, (Box, Tup)) or owner is VLLM else FOREIGN
            if isinstance(owner, Tup) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                index = node.slice.value
                return owner.items[index] if -len(owner.items) <= index < len(owner.items) else FOREIGN
            return owner.element if isinstance(owner, Box) else element_of(owner)
        if isinstance(node, ast.Call):
            return self._call(node, scope)
        return FOREIGN

    def _call(self, node: ast.Call, scope: Scope):
        program, func, args = self.program, node.func, node.args
        added = _read_back(node)
        if added is not None and added in program.added:
            return program.added[added]
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in COPIES and args and (isinstance(func, ast.Name) or isinstance(func.value, ast.Name)
                                        and func.value.id in ("copy", "dataclasses")):
            return self.kind(args[0], scope)
        if isinstance(func, ast.Name):
            callee = scope.lookup(name, program)
            if callee is VLLM:
                return VLLM
            if isinstance(callee, ClassRef):
                return Own(frozenset({callee.name}))
            if isinstance(callee, Function):
                return callee.returns
            if name in EMPTY_CONTAINERS and not args and not node.keywords:
                return Box(EMPTY_CONTAINERS[name], NONE)
            if name in CONTAINERS and args:
                return Box("seq", element_of(self.kind(args[0], scope)))
            if name == "zip":
                return Box("seq", Tup(tuple(element_of(self.kind(arg, scope)) for arg in args)))
            if name == "enumerate" and args:
                return Box("seq", Tup((OWN, element_of(self.kind(args[0], scope)))))
            if name == "range":
                return Box("seq", OWN)
            if name in ("getattr", "type", "vars") and args and self.kind(args[0], scope) is VLLM:
                return VLLM
            return FOREIGN
        if isinstance(func, ast.Attribute):
            owner = self.kind(func.value, scope)
            if owner is VLLM:
                return VLLM
            if isinstance(owner, Own) and owner.classes:
                return program.method_return(owner.classes, func.attr)
            if isinstance(owner, ClassRef):
                return program.method_return({owner.name}, func.attr)
            if isinstance(owner, Box):
                if func.attr in ("get", "pop", "setdefault"):
                    return owner.element
                if func.attr == "values":
                    return Box("seq", owner.element)
                if func.attr == "items":
                    return Box("seq", Tup((FOREIGN, owner.element)))
                if func.attr == "copy":
                    return owner
        return FOREIGN

    # the writes

    def writes(self) -> list[Write]:
        found = set()
        for scope in self.scopes:
            for node in _nodes_of(scope.node):
                for target, meta in _written(node):
                    kind = self.kind(target, scope)
                    if isinstance(kind, OWNED):
                        continue
                    if kind is VLLM or meta or self.engine_room:
                        text = ast.unparse(node).splitlines()[0]
                        found.add(Write(self.path, node.lineno, text[:110], repr(kind)))
        return sorted(found, key=lambda write: write.line)


def _written(node):
    """The objects whose attributes ``node`` writes, each with whether the write is a
    meta-programming form."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
        yield node.value, node.attr in ("__class__", "__dict__")
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
        holder = _dict_of(node.value)
        if holder is not None:
            yield holder, True
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in META_CALLS and node.args:
            name = node.args[1] if len(node.args) > 1 else None
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
            yield node.args[0], not literal or name.value in ("__class__", "__dict__")
        elif isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__"):
            if isinstance(func.value, ast.Name) and func.value.id in ("object", "type") and node.args:
                yield node.args[0], True
            elif isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Name) \
                    and func.value.func.id == "super":
                pass  # a class's own __setattr__ calling its base's: the object is the class's own
            else:
                yield func.value, True
        elif isinstance(func, ast.Attribute) and func.attr in DICT_WRITES:
            holder = _dict_of(func.value)
            if holder is not None:
                yield holder, True


def _helper_name(node, helper: str) -> str | None:
    """The literal attribute name of a call of ``patches.<helper>(obj, "name", ...)``, else None."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    func = node.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) \
        and isinstance(func.value, ast.Name) and func.value.id == "patches" else None
    name = node.args[1]
    return name.value if called == helper and isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def _read_back(node: ast.Call) -> str | None:
    """The attribute a call reads back from an object by its literal name: ``obj.__dict__.get("a")``,
    ``vars(obj).get("a")``, ``getattr(obj, "a", ...)``, ``patches.take_from(obj, "a")``."""
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "get" and _dict_of(func.value) is not None and node.args:
        name = node.args[0]
        return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
    if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1:
        name = node.args[1]
        return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
    return _helper_name(node, "take_from")


def _dict_of(node):
    """``x`` of ``x.__dict__`` or ``vars(x)``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    return None


def _nodes_of(root):
    """The nodes of one scope, without those of the functions, lambdas and classes inside it."""
    stack = list(root.body) if isinstance(getattr(root, "body", None), list) else [root.body]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _inside(inner: Scope, outer: Scope) -> bool:
    scope = inner.parent
    while scope is not None:
        if scope is outer:
            return True
        scope = scope.parent
    return False


def own_sources() -> dict[Path, str]:
    return {path: path.read_text() for package in OWN_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def scan(sources: dict[Path, str]) -> list[Write]:
    """Every write the rule refuses in the harness's modules of ``sources`` (patches.py excepted)."""
    return [write for write in Program(sources).writes()
            if write.path.is_relative_to(HARNESS) and write.path != PATCHES_FILE]


# --- the tests ------------------------------------------------------------------------------------

def test_no_harness_module_writes_a_vllm_attribute_outside_patches():
    found = scan(own_sources())
    assert not found, ("attributes written on vLLM (or unknown) objects outside harness/engine/patches.py; route "
                       "each through a patches helper and list it in PATCHES:\n  " + "\n  ".join(map(str, found)))


# A module of the engine room and one outside it, each line ending "# refused" a write the scan
# must refuse; every other write in them is the harness's own and must pass.
PLANTED_ENGINE = '''
from vllm.model_executor.layers.attention.attention import Attention
import vllm.envs as envs

from harness.engine import patches
from harness.engine.scheduler import Ledger


def plant(layer, runner, function, name):
    Attention.forward = function  # refused
    envs.VLLM_FLAG = 1  # refused
    layer.forward = function  # refused
    del layer.forward  # refused
    runner._state = 1  # refused
    runner.model.counter += 1  # refused
    setattr(runner, name, function)  # refused
    setattr(runner, "state", function)  # refused
    object.__setattr__(runner, "state", function)  # refused
    runner.__setattr__("state", function)  # refused
    runner.__dict__["state"] = function  # refused
    runner.__dict__.update(state=function)  # refused
    vars(runner).pop("state", None)  # refused
    runner.__class__ = Ledger  # refused
    made = Attention(1, 2, 3.0)
    made.impl = None  # refused
    patches.set_on(runner, "_kv_step", function)
    ledger = Ledger("policy")
    ledger.steps += 1
    for each in [Ledger("a"), Ledger("b")]:
        each.steps = 2
    pairs = {"x": Ledger("c")}
    pairs["x"].budget = 3
    kept = pairs.get("x")
    kept.budget = 4


class Holder:
    def __init__(self, runner):
        self.runner = runner
        self.ledger = Ledger("policy")

    def go(self, function):
        self.ledger.steps = 1
        self.ledger.__dict__.update(steps=2)
        self.runner.forward = function  # refused
        self.unknown.forward = function  # refused
'''

PLANTED_ELSEWHERE = '''
def plant(frame, model, name, value):
    frame.index.name = "row"
    model.config.flag = value
    setattr(model, "flag", value)
    setattr(model, name, value)  # refused
    model.__class__ = type(model)  # refused
    model.__dict__.update(flag=value)  # refused
'''


def test_the_scan_refuses_each_form_of_a_planted_patch_and_passes_the_harness_s_own_writes():
    planted = {HARNESS / "engine" / "_planted.py": PLANTED_ENGINE, HARNESS / "analysis" / "_planted.py": PLANTED_ELSEWHERE}
    found = [write for write in scan({**own_sources(), **planted}) if write.path in planted]
    refused = {(path, number) for path, text in planted.items()
               for number, line in enumerate(text.splitlines(), 1) if line.endswith("# refused")}
    assert {(write.path, write.line) for write in found} == refused, "\n".join(map(str, found))


def test_every_vllm_method_a_harness_subclass_redefines_is_listed():
    """A harness class with a vLLM base (the scheduler, the KV managers' subclass, the layer-group
    spec, the logits processor) redefines a vLLM method only where PATCHES lists it, as
    ``overridden`` or ``implemented``, with the parameters checked by ``test_vllm_patches``."""
    import importlib

    from harness.engine.patches import PATCHES

    program = Program(own_sources())
    unlisted, checked = [], set()
    for path, module in program.modules.items():
        if not path.is_relative_to(HARNESS):
            continue
        top = module.scopes[0]
        for node in module.tree.body:
            if not isinstance(node, ast.ClassDef) or not any(module.kind(base, top) is VLLM for base in node.bases):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            cls = getattr(importlib.import_module(name), node.name)
            checked.add(node.name)
            for attribute, value in vars(cls).items():
                code = getattr(getattr(value, "__func__", value), "__code__", None) or \
                    getattr(getattr(value, "fget", None), "__code__", None)
                if code is None or not Path(code.co_filename).is_relative_to(ROOT):
                    continue  # not the harness's code (a dataclass's generated methods)
                vllm_defines = any(attribute in vars(base) for base in cls.__mro__[1:]
                                   if base.__module__.split(".")[0] == "vllm")
                listed = any(patch.name == attribute and patch.how in ("overridden", "implemented")
                             and issubclass(cls, patch.owner_class()) for patch in PATCHES)
                if vllm_defines and not listed:
                    unlisted.append(f"{name}.{node.name}.{attribute}")
    assert {"EvictionScheduler", "PhysicalLengthManager", "BudgetGroupSpec", "ForcedTokens"} <= checked
    assert not unlisted, f"vLLM methods redefined by harness subclasses but not in patches.PATCHES: {unlisted}"


def test_every_name_given_to_a_patches_helper_is_listed_for_one_object():
    """The helpers refuse an unlisted name when they run; this finds it before any engine does."""
    from harness.engine import patches

    listed = {patch.name for patch in patches.PATCHES if patch.how in patches.INSTANCE_KINDS}
    given = {}
    for path, source in own_sources().items():
        for node in ast.walk(ast.parse(source)):
            for helper in ("set_on", "take_from", "replaced_on"):
                name = _helper_name(node, helper)
                if name is not None:
                    given.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert given, "no patches helper call found: the scan's helper names are out of date"
    assert {name: where for name, where in given.items() if name not in listed} == {}
