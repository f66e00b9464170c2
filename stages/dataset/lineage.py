"""The lineage of a dataset version, written by merge beside its shards.

data/merged/lineage.json holds the facts; data/merged/README.md is the same facts as a
Hugging Face dataset card (a YAML header `huggingface_hub.DatasetCard.load` reads, then
text a person reads): rows and tokens, what each source lost at each stage and why, the
target model as served, sampling and chat-template hashes, the tokenizer, the code
commit, the DVC hashes of the upstream outs, and the history of every version this one
extends. The history is carried forward from the base's own lineage.json (or the YAML
header of its card), so a set merged five times lists five versions.

The upstream facts come from reports/{prepare,generate,tokenize}.json (merge depends on
them in dvc.yaml); a report that is missing leaves its part of the card empty. Nothing
secret is written: URL credentials and the values of secret flags are removed first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

import yaml

from stages.common import outputs, params, secrets
from stages.common.errors import StageError, json_type
from stages.common.reading import MAX_DEPTH, json_file, open_regular, read_regular, writable
from stages.dataset import charts, fingerprint, markdown
from stages.dataset.shards import STATE_FILE

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
LINEAGE_FILE = "lineage.json"
# 2: the state hash is `state_hash` (was dataset_fingerprint), sampling.hash; 3: no
# `created` time (a rerun writes the same bytes; reports/runs/merge.json keeps the time)
FORMAT = 3
LOCK = Path("dvc.lock")
SIZE_CATEGORIES = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                   (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M"),
                   (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B")]


# ------------------------------------------------------------------------ facts


def upstream(paths) -> dict[str, str]:
    """The stages whose outs made the new rows, and those outs (merge's `paths`)."""
    return {"prepare": str(paths.prompts), "generate": str(paths.completions),
            "tokenize": str(paths.tokenized)}


def build(merge_report: dict, fingerprint: dict, base: Optional[Path],
          state_hash: str, paths) -> dict:
    """The lineage of the version merge is writing (a JSON-ready dict, secrets removed)."""
    reports = {stage: read_report(paths.reports, stage) for stage in upstream(paths)}
    generate = reports["generate"]
    merged = merge_report["merged"]
    earlier = base_history(base, merge_report["base"], merge_report.get("adopted"))
    # no wall-clock time: a version is its data and its code, so a rerun (or a merge
    # killed and run again) writes the same bytes as a clean run
    commit, dirty = git_commit()
    version = {
        "version": (earlier[-1]["version"] + 1) if earlier else 1,
        "git_commit": commit,
        "git_dirty": dirty,
        "rows": merged["rows"],
        "base_rows": merge_report["base"]["rows"] - merge_report["duplicates"]["dropped_base_rows"],
        "new_rows": merge_report["new"]["rows"] - merge_report["duplicates"]["dropped_new_rows"],
        "tokens": merged["tokens"],
        "model": _text(generate.get("model")),
        "state_hash": state_hash,
    }
    lineage = {
        "format": FORMAT,
        **{k: version[k] for k in ("version", "git_commit", "git_dirty")},
        "rows": merged["rows"],
        "tokens": merged["tokens"],
        "supervised_tokens": merged["loss_tokens"],
        "shards": merged["shards"],
        "state_hash": state_hash,
        "base": {**merge_report["base"], "lineage": bool(earlier),
                 "state_hash": _state_hash_of(base)},
        "new": merge_report["new"],
        "duplicates": merge_report["duplicates"],
        "sources": sources(reports),
        "model": served_model(generate),
        "sampling": {"params": _mapping(generate.get("sampling_params")) or None,
                     "hash": generate.get("sampling"), **turn_facts(generate)},
        "tokenizer": {
            "tokenizer": _mapping(fingerprint.get("tokenizer")) or None,
            "chat_template_sha256": fingerprint.get("chat_template_sha256"),
            "policy": _mapping(fingerprint.get("policy")) or None,
            "versions": _mapping(fingerprint.get("versions")) or None,
        },
        "dvc": dvc_hashes(upstream(paths)),
        "history": earlier + [version],
    }
    return secrets.scrub(lineage)


def read_report(folder: Path, stage: str) -> dict:
    """reports/STAGE.json; {} when there is none. A fact of an unexpected type in it is
    left out where it is used (`_mapping`, `_strings`)."""
    path = Path(folder) / f"{stage}.json"
    try:
        doc = json_file(path)
    except FileNotFoundError:
        log.warning("%s not found: the card says nothing about the %s stage", path, stage)
        return {}
    if not writable(doc):
        raise StageError(f"{path}: holds a lone surrogate, which cannot be written as UTF-8")
    return doc


def sources(reports: dict) -> dict:
    """Per source: read/kept/dropped at prepare, outcomes at generate, rows at tokenize."""
    prepare, generate, tokenize = (_mapping(reports[stage].get("sources"))
                                   for stage in ("prepare", "generate", "tokenize"))
    table = {}
    for name in list(dict.fromkeys([*prepare, *generate, *tokenize])):
        p, g, t = (_mapping(part.get(name)) for part in (prepare, generate, tokenize))
        table[name] = {
            "prepare": {"read": p.get("read"), "kept": p.get("kept"),
                        "dropped": _nonzero(p.get("dropped_by_reason"))} if p else None,
            "generate": {"completed": g.get("completed"), "truncated": g.get("truncated"),
                         "failed": g.get("failed"),
                         "failed_by_kind": _nonzero(g.get("failed_by_kind"))} if g else None,
            "tokenize": {"conversations": t.get("conversations"), "rows": t.get("rows"),
                         "tokens": t.get("tokens"), "loss_tokens": t.get("loss_tokens"),
                         "dropped": _nonzero(t.get("dropped"))} if t else None,
        }
    return table


def _mapping(value: Any) -> dict:
    """`value` if it is a mapping, else {}: a report of another shape adds nothing."""
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> Optional[str]:
    """`value` if it is a string (a model name), else None: the next merge reads it back
    as a history entry, whose fields have their types (`_checked`)."""
    return value if isinstance(value, str) else None


def _strings(value: Any) -> Optional[list[str]]:
    """`value` if it is a list of strings (an argv, URLs), else None."""
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value if ok else None


def _nonzero(counts: Any) -> dict:
    return {k: v for k, v in counts.items() if v} if isinstance(counts, dict) else {}


def turn_facts(generate: dict) -> dict:
    """Samples per prompt and the turn counts of a run that asked by turn (generate's turn
    path, stages/serving/turns.py); nothing for a plain run."""
    if "turns" not in generate:
        return {}
    return {"samples_per_prompt": generate.get("samples_per_prompt"),
            "turns": _mapping(generate.get("turns")) or None}


def served_model(generate: dict) -> dict:
    """The target model as it was served: name, engine, version, launch args (no secrets)."""
    server = _mapping(generate.get("server"))
    args, command = _strings(server.get("args")), _strings(server.get("command"))
    urls = _strings(server.get("urls")) or _strings([server.get("url")]) or []
    return {
        "name": _text(generate.get("model")),
        "engine": server.get("engine"),
        "engine_version": server.get("version"),
        "launched": "args" in server,
        # false: every answer came from the request cache, no engine was started this run
        "started": server.get("started", "args" in server),
        "launch_model": server.get("model"),
        "launch_args": secrets.redact_args(args) if args is not None else None,
        "launch_command": secrets.redact_args(command) if command is not None else None,
        # a URL server's report lists `urls`, a launched one its `url`
        "urls": [secrets.strip_url_credentials(u) for u in urls if u],
        "requests": generate.get("requests"),
        "completed": generate.get("completed"),
        "truncated": generate.get("truncated"),
        "failed": generate.get("failed"),
        "failed_by_kind": generate.get("failed_by_kind"),
        "output_tokens": generate.get("output_tokens"),
    }


# what "the code" is for git_dirty: not params.yaml, reports or dvc.lock, which every run
# rewrites before its version is committed
CODE = ("stages", "dvc.yaml", "pyproject.toml")


def git_commit() -> tuple[Optional[str], Optional[bool]]:
    """HEAD, and whether the code differs from it (uncommitted edits under CODE)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=60)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                 "--", *CODE],
                                capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


# ------------------------------------------------------------------- DVC hashes


def dvc_hashes(outs: dict[str, str]) -> dict:
    """{out: {md5, from}} for each upstream out: dvc.lock's entry when it describes the
    folder on disk (same file count and size). Under `dvc repro` every upstream stage is
    locked before merge runs; a merge run by hand records the hash as unknown rather than
    re-reading every new byte (on a 463 MB new set that cost 0.8 s of a 1.4 s merge)."""
    locked = _lock_outs()
    hashes = {}
    for stage, out in outs.items():
        folder = Path(out)
        if not folder.is_dir():
            hashes[out] = None
            continue
        entry = locked.get(out)
        files = [p for p in folder.rglob("*") if p.is_file()]
        if (entry and entry.get("nfiles") == len(files)
                and entry.get("size") == sum(p.stat().st_size for p in files)):
            hashes[out] = {"stage": stage, "md5": entry.get("md5"), "from": str(LOCK)}
        else:
            hashes[out] = {"stage": stage, "md5": None, "from": f"not in {LOCK} (run outside dvc repro)"}
    return hashes


def _lock_outs() -> dict:
    """dvc.lock's outs by path; {} when it cannot be read as plain data."""
    try:
        doc = yaml.load(read_regular(LOCK).decode("utf-8"), Loader=_HeaderLoader)
    except (OSError, StageError, UnicodeDecodeError, yaml.YAMLError, ValueError,
            params.TooDeep):
        return {}
    found = {}
    for stage in (doc or {}).get("stages", {}).values() if isinstance(doc, dict) else []:
        for out in (stage or {}).get("outs") or []:
            if isinstance(out, dict) and "path" in out:
                found[out["path"]] = out
    return found


# ---------------------------------------------------------------------- history


def base_history(base: Optional[Path], base_totals: dict,
                 adopted: Optional[dict] = None) -> list[dict]:
    """The versions the base already lists; a base without a lineage is version 0, and
    an adopted one (merge.adopt) is version 0 with what adopting it did."""
    if base is None or not base_totals.get("present"):
        return []
    if adopted:
        return [{"version": 0, "git_commit": None, "rows": adopted["rows"],
                 "base_rows": None, "new_rows": None, "tokens": adopted["tokens"],
                 "model": None, "state_hash": None,
                 "note": f"adopted from {adopted['path']} (merge.adopt)", "adopted": adopted}]
    earlier = _read_history(base)
    if earlier is not None:
        return earlier
    if not base_totals.get("rows"):
        return []
    return [{"version": 0, "git_commit": None, "rows": base_totals["rows"],
             "base_rows": None, "new_rows": None, "tokens": base_totals.get("tokens"),
             "model": None, "state_hash": _state_hash_of(base),
             "note": f"base {base} had no lineage card"}]


def _read_history(base: Path) -> Optional[list[dict]]:
    """The history in base/lineage.json, else in the YAML header of base/README.md."""
    path = base / LINEAGE_FILE
    if path.exists():
        doc = json_file(path)
        written = doc.get("format")
        if written is not None and (type(written) is not int or written > FORMAT):
            log.warning("%s: format %s, which this release (format %d) does not know: its "
                        "history is read by the fields it knows, each checked", path,
                        json.dumps(written)[:40], FORMAT)
        return _checked(doc.get("history"), path)
    card = base / CARD_FILE
    if card.exists():
        try:
            with open_regular(card) as f:  # a header is a few KiB; a huge card is not read whole
                head = f.read(MAX_HEADER_BYTES).decode("utf-8", errors="replace")
        except OSError as e:
            raise StageError(f"{card}: cannot read ({e.strerror or e})") from None
        header = front_matter(head, card)
        history = _mapping(header.get("distill_data")).get("history")
        if history is not None:
            return _checked(history, card)
    return None


# what each field of a history entry may hold (besides null); `version` is required
_HISTORY_FIELDS = {"version": int, "rows": int, "base_rows": int, "new_rows": int,
                   "tokens": int, "created": str, "git_commit": str, "model": str,
                   "note": str, "state_hash": str, "adopted": dict}
OLD_KEYS = {"dataset_fingerprint": "state_hash"}  # format 1's name, in earlier versions' history
MAX_HEADER_BYTES = 16 << 20


def _checked(history: Any, path: Path) -> list[dict]:
    """`history` if it is a list of versions whose fields have their types, else a
    StageError naming the first bad field (a carried-forward value must stay writable
    as strict JSON and as a table cell)."""
    if not isinstance(history, list) or not all(isinstance(v, dict) for v in history):
        raise StageError(f"{path}: history is not a list of versions (merge.base's lineage)")
    for i, v in enumerate(history):
        for old, new in OLD_KEYS.items():
            if old in v:
                v.setdefault(new, v.pop(old))
        if v.get("version") is None:
            raise StageError(f"{path}: history[{i}].version is missing (merge.base's lineage)")
        for key, kind in _HISTORY_FIELDS.items():
            value = v.get(key)
            if value is None:
                continue
            if type(value) is not kind or (kind is int and not 0 <= value < 2**63):
                want = {int: "a count", str: "a string", dict: "an object"}[kind]
                raise StageError(f"{path}: history[{i}].{key} is {json_type(value)}, not "
                                 f"{want} or null (merge.base's lineage)")
            if kind is not int and not writable(value):
                raise StageError(f"{path}: history[{i}].{key} holds a lone surrogate, which "
                                 "cannot be written as UTF-8 (merge.base's lineage)")
            where = _not_finite(value, f"history[{i}].{key}")
            if where:
                raise StageError(f"{path}: {where[:200]}, not a finite number: strict JSON "
                                 "and the card hold none (merge.base's lineage)")
    if history and history[-1]["version"] >= 2**63 - 1:  # build numbers the next one
        raise StageError(f"{path}: history[{len(history) - 1}].version is "
                         f"{history[-1]['version']}: the next version would not be a count "
                         "(merge.base's lineage)")
    return history


def _not_finite(value: Any, name: str) -> Optional[str]:
    """Where in `value` a NaN or infinity is (Python's JSON and YAML read them, strict JSON
    has none), as NAME.key[i]; None when nowhere. No recursion: the depth is the file's."""
    stack = [(value, name)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"{where} is {node}"
        if isinstance(node, dict):
            stack.extend(reversed([(v, f"{where}.{k}") for k, v in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([(v, f"{where}[{j}]") for j, v in enumerate(node)]))
    return None


class _HeaderLoader(params.BoundedLoader):
    """A card header as data: nesting bounded, and no aliases (an alias bomb costs
    nothing to load and forever to walk)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases are not read",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def front_matter(text: str, path: Path) -> dict:
    """The YAML header of a card; {} (and a warning) when it cannot be read as data."""
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")  # saved on Windows
    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---", 4)
    try:
        doc = yaml.load(text[4:end], Loader=_HeaderLoader) if end > 0 else None
    except params.TooDeep:
        why = f"nested deeper than {MAX_DEPTH} levels"
    except (yaml.YAMLError, ValueError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
    else:
        return doc if isinstance(doc, dict) else {}
    log.warning("%s: the YAML header is not readable (%s): its history is not carried "
                "forward", path, why)
    return {}


def _state_hash_of(folder: Optional[Path]) -> Optional[str]:
    return None if folder is None else fingerprint.read_state_hash(folder / STATE_FILE)


# ------------------------------------------------------------------------ write


def write(folder: Path, lineage: dict, paths) -> None:
    """lineage.json and README.md into `folder` (merge's temporary output folder for
    `paths.out`)."""
    lineage = secrets.WRITTEN.scrub(lineage)  # the card is built from what is shown
    outputs.write_json(folder / LINEAGE_FILE, lineage)
    outputs.write_text(folder / CARD_FILE, card(lineage, paths))


# libyaml's emitter writes the same text 4x faster (a history of 10,000 versions: 13 s
# in pure Python); PyYAML built without it falls back
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def card(lin: dict, paths) -> str:
    header = {
        "pretty_name": f"distill-data training set, version {lin['version']}",
        "size_categories": [_size_category(lin["rows"])],
        "task_categories": ["text-generation"],
        "tags": ["distillation", "synthetic", "tokenized", "dvc"],
        "distill_data": {
            "version": lin["version"],
            "rows": lin["rows"],
            "tokens": lin["tokens"],
            "supervised_tokens": lin["supervised_tokens"],
            "model": lin["model"]["name"],
            "git_commit": lin["git_commit"],
            "history": lin["history"],
        },
    }
    parts = [
        "---\n" + yaml.dump(header, Dumper=_DUMPER, sort_keys=False, allow_unicode=True)
        + "---\n",
        _intro(lin, paths.out), _contents(lin), *_adopted(lin["history"]),
        _sources_table(lin["sources"]), _model(lin),
        _tokenizer(lin["tokenizer"]), _training(paths), _provenance(lin), _history(lin["history"]),
        _older_versions(),
    ]
    return "\n".join(parts)


def _size_category(rows: int) -> str:
    return next((name for limit, name in SIZE_CATEGORIES if rows < limit), "n>1B")


# Every value below comes from data, reports or params, not from this module: it is
# written through markdown.text (prose, table cells) or markdown.code (code spans).


def _n(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else (
        "–" if value is None else markdown.text(value))


def _reasons(counts: Optional[dict]) -> str:
    return ", ".join(f"{markdown.text(k)} {_n(v)}" for k, v in _mapping(counts).items()) or "–"


def _intro(lin: dict, merged: Path) -> str:
    commit = markdown.text(lin["git_commit"] or "unknown")
    if lin["git_dirty"]:
        commit += " plus uncommitted edits to the code"
    opened = markdown.code(f"datasets.load_from_disk({json.dumps(str(merged))})")
    return (
        f"# distill-data training set, version {lin['version']}\n\n"
        f"Written by the merge stage from code at git commit {commit}. "
        f"Open it with {opened}; the same facts are in `{LINEAGE_FILE}` beside this card.\n"
    )


def _contents(lin: dict) -> str:
    base, new, dup = lin["base"], lin["new"], lin["duplicates"]
    rows = [("this version", lin["rows"], lin["tokens"], lin["supervised_tokens"],
             lin["shards"]),
            (f"base ({markdown.code(base['path'], cell=True)})", base["rows"], base["tokens"],
             base["loss_tokens"], base["shards"]),
            (f"new ({markdown.code(new['path'], cell=True)})", new["rows"], new["tokens"],
             new["loss_tokens"], new["shards"])]
    lines = ["## Contents\n", "| | rows | tokens | supervised tokens | shards |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {a} | {_n(b)} | {_n(c)} | {_n(d)} | {_n(e)} |" for a, b, c, d, e in rows]
    lines.append(
        f"\nIds in both base and new: {_n(dup['ids'])} (policy {markdown.code(dup['policy'])}; dropped "
        f"{_n(dup['dropped_base_rows'])} base rows, {_n(dup['dropped_new_rows'])} new rows).\n")
    return "\n".join(lines)


def _adopted(history: list[dict]) -> list[str]:
    """Where version 0 came from, when merge adopted a set another tool wrote (no part
    otherwise)."""
    entry = next((v for v in history if isinstance(v.get("adopted"), dict)), None)
    if entry is None:
        return []
    a = entry["adopted"]
    files = a.get("files") if isinstance(a.get("files"), list) else []
    lines = [
        "## Adopted base\n",
        f"Version {_n(entry['version'])} is the set at {markdown.code(a.get('path'))} "
        f"({markdown.code(a.get('folder'))}), written by another tool and converted once by "
        f"`merge.adopt`: {_n(a.get('rows'))} rows, {_n(a.get('tokens'))} tokens "
        f"({_n(a.get('loss_tokens'))} supervised) from {_n(len(files))} "
        f"{markdown.text(', '.join(map(str, a.get('formats') or [])))} files, in their "
        "order. Its shards are reused byte for byte by every later version.\n",
        "| column | from |", "|---|---|",
    ]
    lines += [f"| {markdown.text(k)} | {markdown.text(v)} |"
              for k, v in _mapping(a.get("mapping")).items()]
    shape = ", ".join(f"{k} {v}" for k, v in _mapping(a.get("columns")).items())
    dropped = ", ".join(map(str, a.get("dropped_columns") or [])) or "none"
    lines.append(f"\nThe base's columns as found: {markdown.text(shape) or '–'}. Dropped: "
                 f"{markdown.text(dropped)}. Rows repeating an earlier row's content: "
                 f"{_n(a.get('repeated_rows'))}.\n")
    if a.get("fully_supervised_rows"):  # an adoption before that count has none
        lines.append(f"Rows training every token, the prompt included: "
                     f"{_n(a['fully_supervised_rows'])} "
                     f"({markdown.code('merge.adopt_fully_supervised: ' + str(a.get('fully_supervised')))}).\n")
    return ["\n".join(lines)]


def _sources_table(table: dict) -> str:
    lines = ["## Sources of the new rows\n",
             "| source | read | kept | dropped at prepare | answered | truncated | failed "
             "| rows | dropped at tokenize |",
             "|---|---:|---:|---|---:|---:|---|---:|---|"]
    for name, s in table.items():
        p, g, t = s["prepare"] or {}, s["generate"] or {}, s["tokenize"] or {}
        failed = _n(g.get("failed"))
        if g.get("failed_by_kind"):
            failed += f" ({_reasons(g['failed_by_kind'])})"
        lines.append(
            f"| {markdown.text(name)} | {_n(p.get('read'))} | {_n(p.get('kept'))} | "
            f"{_reasons(p.get('dropped'))} | {_n(g.get('completed'))} | "
            f"{_n(g.get('truncated'))} | {failed} | {_n(t.get('rows'))} | "
            f"{_reasons(t.get('dropped'))} |")
    if not table:
        lines.append("| (no stage reports were found) | | | | | | | | |")
    lines.append("\nread/kept/dropped: prepare; answered/truncated/failed: generate "
                 "(truncated answers are kept there and dropped at tokenize unless "
                 "`tokenize.keep_truncated`); rows/dropped: tokenize.\n")
    return "\n".join(lines)


def _model(lin: dict) -> str:
    m, sampling = lin["model"], lin["sampling"]
    engine = markdown.text(m["engine"] or "unknown engine")
    if m["engine_version"]:
        engine += f" {markdown.text(m['engine_version'])}"
    lines = ["## Target model\n", f"- model: {markdown.code(m['name'])}", f"- engine: {engine}"]
    if m["launched"]:
        args = " ".join(m["launch_args"] or []) or "(none)"
        lines.append(f"- launched by the generate stage: {markdown.code(m['launch_model'])} "
                     f"with args {markdown.code(args)}")
        if not m["started"]:
            lines.append("- not started by the last generate run: every answer came from "
                         "the request cache")
        if m["launch_command"]:
            lines.append(f"- launch command: {markdown.code(' '.join(m['launch_command']))}")
    elif m["urls"]:
        urls = ", ".join(markdown.text(u) for u in m["urls"])
        lines.append(f"- served at: {urls} (not launched by this pipeline)")
    kinds = f" ({_reasons(m['failed_by_kind'])})" if m["failed_by_kind"] else ""
    lines.append(f"- requests {_n(m['requests'])}: answered {_n(m['completed'])} "
                 f"(truncated {_n(m['truncated'])}), failed {_n(m['failed'])}{kinds}")
    lines.append(f"- output tokens: {_n(m['output_tokens'])}")
    sampled = ", ".join(f"{markdown.text(k)} {_n(v)}"
                        for k, v in _mapping(sampling["params"]).items())
    lines.append(f"- sampling: {sampled or 'unknown'} (hash {markdown.code(sampling['hash'])})\n")
    return "\n".join(lines)


def _tokenizer(tok: dict) -> str:
    t, policy = _mapping(tok["tokenizer"]), _mapping(tok["policy"])
    keys = ("multi_turn", "max_seq_len", "on_too_long", "keep_truncated", "min_loss_tokens",
            "enable_thinking", "ids")
    versions = _mapping(tok["versions"])
    lines = ["## Tokenizer\n",
             f"- tokenizer: {markdown.code(t.get('name'))}, vocabulary "
             f"{_n(t.get('vocab_size'))} (sha256 {markdown.code(t.get('vocab_sha256'))})",
             f"- chat template sha256: {markdown.code(tok['chat_template_sha256'])}",
             "- policy: " + (", ".join(f"{k} {_n(policy[k])}" for k in keys if k in policy)
                             or "–"),
             "- libraries: " + ", ".join(f"{markdown.text(k)} {_n(v)}"
                                         for k, v in versions.items()) + "\n"]
    return "\n".join(lines)


def _training(paths) -> str:
    """Where validate's verdict on this version is: it runs after merge and never writes
    into data/merged, so the card links its reports (same git commit as this version)."""
    def link(path: Path) -> str:  # from the card, in the merged folder
        return os.path.relpath(path, paths.out)

    report = Path(link(paths.reports / "validate.json"))
    pictures = [f"![{title}]({link(charts.picture(paths.reports, name))})"
                for name, (title, _) in charts.PICTURES.items()]
    return (
        "## Ready to train\n\n"
        f"The validate stage checks this version after merge writes it. [{report.name}]"
        f"({report}) holds every check, a real training step on it (loss, tokens/s, peak "
        "memory, the longest batch) and the token budget of an epoch (batches, optimizer "
        "steps, padding padded vs packed, supervised tokens per step by source).\n\n"
        + "\n\n".join(pictures) + "\n\n"
        f"Sample rows of every source, supervised tokens marked: [{charts.SAMPLES}]"
        f"({link(charts.samples(paths.reports))}) (any row: `python -m stages.show --id ID`).\n\n"
        "Training batches (padded or packed, labels masked): "
        "`from stages.dataset.loader import batches`.\n"
    )


def _provenance(lin: dict) -> str:
    lines = ["## Provenance\n", f"- git commit: {markdown.code(lin['git_commit'] or 'unknown')}",
             f"- state hash (state.json `_fingerprint`): {markdown.code(lin['state_hash'])}; "
             f"base: {markdown.code(lin['base']['state_hash'])}", "",
             "| stage | out | DVC md5 | from |", "|---|---|---|---|"]
    for out, h in lin["dvc"].items():
        where = markdown.code(out, cell=True)
        if h:
            lines.append(f"| {h['stage']} | {where} | {markdown.code(h['md5'], cell=True)} | "
                         f"{markdown.text(h['from'])} |")
        else:
            lines.append(f"| | {where} | (not on disk) | |")
    return "\n".join(lines) + "\n"


def _history(history: list[dict]) -> str:
    # no `created` column: this release writes no time (earlier versions' stays in the
    # history of lineage.json and the header)
    lines = ["## History\n", "Every version this one extends, oldest first.\n",
             "| version | git commit | rows | base rows | new rows | model |",
             "|---:|---|---:|---:|---:|---|"]
    for v in history:
        commit = markdown.text((v.get("git_commit") or "–")[:12])
        lines.append(f"| {v['version']} | {commit} | "
                     f"{_n(v.get('rows'))} | {_n(v.get('base_rows'))} | "
                     f"{_n(v.get('new_rows'))} | "
                     f"{markdown.text(v.get('model') or v.get('note') or '–')} |")
    return "\n".join(lines) + "\n"


def _older_versions() -> str:
    return (
        "## Lineage of an older version\n\n"
        "The card is part of the data: check out the version and read it.\n\n"
        "```bash\ngit checkout <commit> && dvc checkout data/merged\n"
        "cat data/merged/README.md\n"
        "# or, without touching the workspace:\n"
        "dvc get --rev <commit> <repo-url-or-path> data/merged/README.md -o card.md\n```\n"
    )
