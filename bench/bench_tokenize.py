"""Benchmark the tokenize stage against the tokenizer itself and the naive way.

  python bench/bench_tokenize.py            1,000 conversations; 50K rows for memory
  python bench/bench_tokenize.py --quick    300 conversations; 5K rows (also BENCH_QUICK=1)

Conversations are generated with realistic length and shape for the reference run: mean
about 2,700 tokens, mostly the thinking block; 20% with a system prompt, 20% with earlier
turns, 5% with tools and a tool call. All figures use the bundled Qwen3.6 tokenizer, on
this machine's cores, in one run. Each kind of run but the in-process floor repeats in a
process of its own (Side), as `python -m stages.tokenize` runs alone. The stage and its
baselines run in rounds (3 quick, 6 full), each run beside its pair's other side, the
order turned round every round; each ratio is the median over rounds of the pair's two
times (the cores of a shared machine change speed by themselves every few seconds), the
tok/s figures the best of the rounds.

  tokenize_vs_floor       stage tokens/s at num_proc=2 (render + encode + mask + Arrow
                          write, JSON parsing and the serve-render check of every row
                          against its engine token ids included) divided
                          by `Tokenizer.encode_batch_fast` on the pre-rendered texts (2
                          threads) - goal >= 0.85
  tokenize_vs_floor_1proc stage at num_proc=1 / the tokenizer on one thread: the stage's
                          own cost per core, whatever the other jobs on the machine do
  tokenize_vs_naive       stage at num_proc=2 divided by the naive way in one process:
                          per sample `apply_chat_template(tokenize=True)`, then, for each
                          assistant turn, the prefix before it and the prefix through its
                          end tokenized again (SpecForge-style) - goal >= 4
  tokenize_vs_naive_1proc the same with the stage at num_proc=1
  tokenize_vs_naive_min   against a leaner naive way that takes the end of the final turn
                          from the whole encode instead of encoding the prefix again
  tokenize_scaling_2proc  stage at num_proc=2 / num_proc=1 - goal >= 1.7
  tokenize_machine_scaling_2proc  the bare tokenizer in 2 processes / 1, measured alongside:
                          what the machine gave two processes at the time (another job on
                          the 2 cores pulls both scaling figures down together)
  tokenize_peak_rss_mb    peak memory (summed PSS of the stage process and its workers)
                          tokenizing 50K rows with num_proc=2, in a subprocess; the rows are
                          short (~200 tokens) to keep the run short: memory is bounded per
                          chunk, not per row
  tokenize_rss_growth_mb  peak at 50K rows minus peak at 10K rows (flat: near 0)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "tokenize"
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from stages.common import params  # noqa: E402

ROUNDS, ROUNDS_QUICK = 6, 3  # timed rounds of every run (see main)
TOKENIZER = params.Tokenize.tokenizer  # the stage's default: the bundled Qwen3.6 one
COMMON = (
    "the of and to in is that it for as with was on be by this are or at from an but not "
    "have which can we if so all one what there when more will about into out up then them "
    "some could these other than only its also may time first like any how now two our way "
    "each well even new because most over such after very where much before through back "
    "just those should see while value function number first second term equation answer "
    "check let me wait so the result gives us we need to compute step since case both sides "
    "means therefore consider maybe actually hmm right correct total factor"
).split()
SYLLABLES = ("ka ro mi te su lan ver pro con di al ex tion ment ing er ab ul ze por mat "
             "gen ic hy dro log phy sis tra ble ous na").split()


class Text:
    """Pseudo-English with a Zipf tail, numbers, formulas and the odd code line."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        rare = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))
                       for _ in range(20000)})
        self.rare = rare
        self.rare_cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(rare))))

    def sentence(self, n: int) -> str:
        rng = self.rng
        words = []
        for _ in range(n):
            r = rng.random()
            if r < 0.72:
                words.append(rng.choice(COMMON))
            elif r < 0.95:
                words.append(rng.choices(self.rare, cum_weights=self.rare_cum)[0])
            else:
                words.append(f"{rng.randint(0, 999)}{rng.choice(['', '.5', 'x', '^2'])}")
        s = " ".join(words)
        if rng.random() < 0.1:
            s += f", so ${rng.randint(2, 99)}x + {rng.randint(1, 50)} = {rng.randint(10, 999)}$"
        return s[:1].upper() + s[1:] + rng.choice([".", ".", ".", "?", ":"])

    def prose(self, words: int) -> str:
        paras, left = [], words
        while left > 0:
            n = min(left, self.rng.randint(25, 90))
            left -= n
            para = " ".join(self.sentence(k) for k in _split(self.rng, n))
            if self.rng.random() < 0.06:
                para += "\n\n```python\ndef f(x):\n    return x * 2 + 1\n```"
            paras.append(para)
        return "\n\n".join(paras)


def _split(rng: random.Random, n: int) -> list[int]:
    out = []
    while n > 0:
        k = min(n, rng.randint(6, 22))
        out.append(k)
        n -= k
    return out


TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                    "required": ["query"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate math.",
     "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}},
]


def conversation(rng: random.Random, text: Text, i: int, scale: float = 1.0) -> dict:
    msgs: list[dict] = []
    row: dict = {"id": f"bench-{i}", "source": rng.choice(["infinity", "webinstruct", "code"])}
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": text.prose(rng.randint(15, 50))})
    if rng.random() < 0.05:
        row["tools"] = TOOLS
        msgs.append({"role": "user", "content": text.prose(rng.randint(20, 60))})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "search",
                                              "arguments": {"query": text.sentence(6)}}}]})
        msgs.append({"role": "tool", "content": text.prose(rng.randint(40, 120))})
    elif rng.random() < 0.2:
        for _ in range(rng.choice((1, 1, 2))):
            msgs.append({"role": "user", "content": text.prose(rng.randint(20, 120))})
            msgs.append({"role": "assistant", "content": text.prose(rng.randint(60, 250))})
    msgs.append({"role": "user", "content": text.prose(int(rng.randint(25, 170) * scale))})
    msgs.append({
        "role": "assistant",
        "reasoning_content": text.prose(int(rng.randint(520, 1500) * scale)),
        "content": text.prose(int(rng.randint(60, 340) * scale)),
    })
    row.update(messages=msgs, finish_reason="stop", truncated=False,
               usage={"prompt_tokens": 0, "completion_tokens": 0}, model="bench", sampling="x")
    return row


def served(row: dict, tok) -> None:
    """What vLLM would have kept for the row (generate's `engine_tokens`), so that the
    stage's serve-render check runs on every row: the prompt as the engine encodes it."""
    from stages.chat.conversation import token_ids_digest

    prompt = tok.apply_chat_template(row["messages"][:-1], tools=row.get("tools"),
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    final = row["messages"][-1]
    written = f"{final['reasoning_content']}\n</think>\n\n{final['content']}<|im_end|>"
    n = len(tok(written, add_special_tokens=False)["input_ids"])
    row["usage"] = {"prompt_tokens": len(ids), "completion_tokens": n}
    row["engine_tokens"] = {"prompt_sha256": token_ids_digest(ids), "prompt": len(ids),
                            "completion": n}


def make_completions(path: Path, n: int, scale: float = 1.0, seed: int = 0,
                     tok=None) -> None:
    if path.exists():
        return
    rng = random.Random(seed)
    text = Text(rng)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(n):
            row = conversation(rng, text, i, scale)
            if tok is not None:
                served(row, tok)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.rename(path)


def _best(fn, repeat: int = 2) -> float:
    return min(_timed(fn) for _ in range(repeat))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_TEXTS: list[str] = []


def _encode_part(part: tuple[int, int]) -> int:
    """Tokens of the texts _TEXTS[lo:hi], encoded."""
    from stages.chat.encoder import off_main_thread
    from stages.models.tokenizer import load_once

    tok = load_once(TOKENIZER)  # inherited through fork
    # off the main thread, as the stage does (the main thread's heap is slower)
    encoded = off_main_thread(tok.backend_tokenizer.encode_batch_fast,
                              _TEXTS[part[0]:part[1]], add_special_tokens=False)
    return sum(map(len, encoded))


class single_threaded:
    """TOKENIZERS_PARALLELISM=false for the block (forked workers inherit it)."""

    def __enter__(self) -> None:
        self.saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.saved


def bare_one(texts: list[str]) -> None:
    """The bare tokenizer on one thread."""
    _TEXTS[:] = texts
    with single_threaded():
        _encode_part((0, len(texts)))


def bare_two(texts: list[str]) -> None:
    """The bare tokenizer in 2 forked single-threaded processes (fork included, as in the
    stage): with `bare_one`, the ceiling for any 2-process tokenizer at this moment."""
    import multiprocessing

    _TEXTS[:] = texts
    half = len(texts) // 2
    with single_threaded(), multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_encode_part, [(0, half), (half, len(texts))])


def _peak_memory(cmd: list[str], env: dict) -> float:
    """Run `cmd`; the peak over time of the PSS summed over it and its children, in MB."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    peak = 0.0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_full_info().pss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                return
            peak = max(peak, total / 2**20)
            done.wait(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    err = proc.communicate()[1].decode()
    done.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"tokenize run failed:\n{err[-2000:]}")
    return peak


# a side: one kind of timed run, repeated on demand in a process of its own (see Side)
SIDE = """
import json, logging, sys
logging.disable(logging.WARNING)
sys.path[:0] = ["bench"]
import bench_tokenize
job = bench_tokenize.side_job(*sys.argv[1:])
print(json.dumps(job()), flush=True)  # a warm-up run and what it returned
for _ in sys.stdin:
    job()
    print("done", flush=True)
"""


def rendered(path: Path, rows: int | None = None) -> list[str]:
    """The completions' conversations (the first `rows` of them) as the chat template
    writes them."""
    from stages.models.tokenizer import load_once

    tok = load_once(TOKENIZER)
    with open(path, encoding="utf-8") as f:
        return [tok.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=False)
                for r in map(json.loads, itertools.islice(f, rows))]


def side_job(what: str, path: str, out: str):
    """The run a side repeats: `stage1`/`stage2` the stage at that num_proc, `bare1`/
    `bare2` the bare tokenizer on one thread / in 2 processes."""
    if what.startswith("stage"):
        from stages.tokenize import tokenize_file

        procs = int(what[len("stage"):])
        return lambda: tokenize_file(path, out, num_proc=procs, max_seq_len=1 << 20)
    texts = rendered(Path(path))
    bare = {"bare1": bare_one, "bare2": bare_two}[what]
    return lambda: bare(texts)


class Side:
    """Runs of one kind (`side_job`) on demand in a process that does nothing else, as
    `python -m stages.tokenize` does nothing but tokenize. Forked workers inherit their
    parent's C heap: run in this process, beside the in-process floor's own encoding, the
    stage's workers took ~10% more CPU for the same chunks (dev/LOG.md, 2026-12-06)."""

    def __init__(self, what: str, path: Path, out: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SIDE, what, str(path), str(out)], cwd=ROOT,
            env=harness.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = json.loads(self._reply())

    def _reply(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the side process ended (exit {self.proc.wait()})")
        return line

    def run(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self._reply() == "done\n"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def memory_run(rows: int) -> float:
    path = WORK / f"short-v2-{rows}.jsonl"
    make_completions(path, rows, scale=0.06, seed=rows)
    out = WORK / f"out-mem-{rows}"
    code = ("import sys; from stages.tokenize import tokenize_file; "
            f"tokenize_file({str(path)!r}, {str(out)!r}, num_proc=2, max_seq_len=1 << 20)")
    return _peak_memory([sys.executable, "-c", code], harness.env())


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    from stages.models.tokenizer import load_once

    n = 300 if quick else 1000
    n_naive = 60 if quick else 150
    tok = load_once(TOKENIZER)
    path = WORK / f"realistic-v3-{n}.jsonl"  # v3: Qwen3.6 format, engine token ids kept
    make_completions(path, n, tok=tok)
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    texts = rendered(path)
    backend = tok.backend_tokenizer
    tokens = sum(map(len, backend.encode_batch_fast(texts, add_special_tokens=False)))

    sides = {what: Side(what, path, WORK / f"out-{what}")
             for what in ("stage2", "stage1", "bare1", "bare2")}
    report = sides["stage2"].first
    assert report["rows"] == n, report["dropped"]
    check = report["serve_check"]  # every row checked against its engine ids, all equal
    assert check["checked_by_ids"] == n and check["mismatches"] == 0, check
    # Each core of these shared machines changes speed by itself every few seconds (up to
    # 1.5x; dev/LOG.md 2026-12-06), so each ratio is the median over rounds of two runs
    # made back to back, the order turned round every round: a slow spell then weighs on
    # one round's pair, not on one side of the figure.
    runs = {
        "floor": lambda: backend.encode_batch_fast(texts, add_special_tokens=False),
        "stage2": sides["stage2"].run,
        "stage1": sides["stage1"].run,
        "floor_1": sides["bare1"].run,
        "floor_2proc": sides["bare2"].run,
    }
    timings: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)  # each neighbour pair here is one figure's pair
    for r in range(ROUNDS_QUICK if quick else ROUNDS):
        for name in order if r % 2 == 0 else order[::-1]:
            timings[name].append(_timed(runs[name]))
        print("   round", r + 1, " ".join(f"{k} {v[-1]:.2f}s" for k, v in timings.items()),
              flush=True)

    for side in sides.values():
        side.close()

    def paired(slower: str, faster: str) -> float:
        """Median over rounds of time(slower) / time(faster)."""
        return statistics.median(a / b for a, b in zip(timings[slower], timings[faster]))

    same_tokens = report["tokens"] / tokens  # the stage's rows hold the rendered texts' tokens

    naive_rows = rows[:n_naive]
    naive_tokens = [0]

    def encode(msgs, tools, **kw) -> list[int]:
        return tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False, **kw)

    def naive(through_end: bool) -> None:
        """The per-sample way: encode the conversation, then find each assistant turn by
        encoding the prefix before it (and, as SpecForge-style parsers do, the prefix
        through its end)."""
        naive_tokens[0] = 0
        for r in naive_rows:
            msgs, tools = r["messages"], r.get("tools")
            ids = encode(msgs, tools)
            mask = [0] * len(ids)
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = len(encode(msgs[:i], tools, add_generation_prompt=True))
                last = i == len(msgs) - 1
                end = len(ids) if last and not through_end else len(encode(msgs[: i + 1], tools))
                mask[start:end] = [1] * (end - start)
            naive_tokens[0] += len(ids)

    seconds = _best(lambda: naive(True), repeat=1 if quick else 2)
    naive_rate = naive_tokens[0] / seconds
    seconds = _best(lambda: naive(False), repeat=1 if quick else 2)
    naive_min_rate = naive_tokens[0] / seconds
    stage2, stage1 = min(timings["stage2"]), min(timings["stage1"])
    rate1, rate2 = report["tokens"] / stage1, report["tokens"] / stage2

    big, small = (5_000, 1_000) if quick else (50_000, 10_000)
    rss_big = memory_run(big)
    rss_small = memory_run(small)
    return {
        "tokenize_vs_floor": round(same_tokens * paired("floor", "stage2"), 3),
        "tokenize_vs_naive": round(rate2 / naive_rate, 2),
        "tokenize_vs_naive_1proc": round(rate1 / naive_rate, 2),
        "tokenize_vs_naive_min": round(rate2 / naive_min_rate, 2),
        "tokenize_scaling_2proc": round(paired("stage1", "stage2"), 3),
        "tokenize_machine_scaling_2proc": round(paired("floor_1", "floor_2proc"), 3),
        "tokenize_vs_floor_1proc": round(same_tokens * paired("floor_1", "stage1"), 3),
        "tokenize_peak_rss_mb": round(rss_big, 1),
        "tokenize_rss_growth_mb": round(rss_big - rss_small, 1),
        "tokenize_mean_tokens_per_row": round(tokens / n),
        "tokenize_stage_tok_per_s": round(rate2),
        "tokenize_floor_tok_per_s": round(tokens / min(timings["floor"])),
    }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
