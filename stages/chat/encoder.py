"""Chat rendering and assistant-only loss masks: render once, encode once, mask from ids.

  enc = ChatEncoder(tokenizer, enable_thinking=True)
  rows = enc.encode(messages, tools, policy="last")  # EncodedRow: ids, mask, prompt_len
  batch = enc.encode_plans(plans)  # many conversations' enc.plan(...) rows in one call

A conversation's strings are sanitized (stages/chat/controltext.py) and rendered once
with the chat template; the rendering is cut at every control token the template wrote,
at the end of the generation prompt and at the edges of the supervised spans, and the
pieces of a whole batch are encoded in one call with control-token parsing off. The mask
is 1 on the pieces inside supervised spans. Which spans (ChatML turns, `{% generation %}`
blocks), the multi-turn policies, and the templates and tokenizers refused:
docs/stages.md ("tokenize").
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from stages.chat import thinking
from stages.chat.controltext import ControlTokenCodec
from stages.common.errors import StageError

POLICIES = ("last", "all", "expand")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


@dataclass
class RenderedRow:
    """One output row before encoding: its rendering cut into parts.

    `parts[k]` is a control-token id, or None for the next string of `texts`; `sup[k]`
    says whether part k is supervised. The first `prompt_parts` parts are the generation
    prompt, i.e. `full[:cut]`.
    """

    turn: int  # 1-based assistant turn this row ends with
    n_messages: int  # the row renders messages[:n_messages]
    full: str  # sanitized rendering
    cut: int  # end of the generation prompt in `full`
    texts: list[str]
    parts: list[int | None]
    sup: list[bool]
    prompt_parts: int
    lookalikes: bool


class ForTemplate(NamedTuple):
    """A conversation as the chat template gets it."""

    messages: list[dict]
    tools: list | None
    lookalikes: bool  # whether its text spelled a control token (now sentinels)


class EncodedRow(NamedTuple):
    """One row of a conversation, encoded."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # int8: the loss mask
    prompt_len: int  # tokens of its generation prompt


@dataclass
class Batch:
    ids: np.ndarray  # int32, all rows back to back
    mask: np.ndarray  # int8, same length
    offsets: np.ndarray  # int64, len(rows) + 1
    prompt_lens: list[int]  # tokens of each row's generation prompt

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


_helper: tuple[int, Any] | None = None


def off_main_thread(fn, *args, **kwargs):
    """Run `fn` on this process's helper thread and wait for it.

    The Rust tokenizer allocates a lot; on the main thread its allocations go to glibc's
    main heap, and it runs ~1.6x slower there than on any other thread (measured here:
    300K vs 490K tokens/s single-threaded, same text). A worker thread gets its own heap.
    """
    global _helper
    import concurrent.futures

    if _helper is None or _helper[0] != os.getpid():  # threads do not survive a fork
        _helper = (os.getpid(), concurrent.futures.ThreadPoolExecutor(1, "tokenize"))
    return _helper[1].submit(fn, *args, **kwargs).result()


def _end_helper() -> None:
    """Before this process forks, its helper thread ends (the next call starts another).
    Workers forked while the parent's helper was alive, after it had encoded, spent ~7%
    more CPU on the same chunks: 2.33-2.38 s, against 2.12-2.20 s with the helper ended
    before the fork or never started. Why (glibc's heap, the tokenizer) was not pinned
    down (dev/LOG.md, 2026-12-06)."""
    global _helper
    if _helper is not None and _helper[0] == os.getpid():
        _helper[1].shutdown(wait=True)
    _helper = None


os.register_at_fork(before=_end_helper)


def with_parsed_arguments(messages: list[dict]) -> list[dict]:
    """The conversation with JSON-text tool-call arguments parsed into objects, as vLLM
    and SGLang hand them to the template (an OpenAI reply carries arguments as JSON text;
    templates iterate over them as a mapping). Done before sanitizing: a JSON escape like
    \\u003c must not spell a control token only once the template sees the value.
    Arguments that are not a JSON object stay text."""
    if not any(isinstance(m, dict) and m.get("tool_calls") for m in messages):
        return messages
    return [{**m, "tool_calls": _calls_with_parsed_arguments(m["tool_calls"])}
            if isinstance(m, dict) and m.get("tool_calls") else m for m in messages]


def _calls_with_parsed_arguments(calls: Any) -> Any:
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return out


# (backend id, control tokens) -> (that backend, its copy with them special):
# ChatEncoder._spelling_encoder
_SPELLING_COPIES: dict = {}


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and encodes them with masks.

    The tokenizer runs on rayon threads unless TOKENIZERS_PARALLELISM=false; the stage's
    workers set it so that `num_proc` processes use `num_proc` cores.
    """

    def __init__(self, tok, *, enable_thinking: bool = True, name: str | None = None,
                 chat_template: str | None = None):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.tok = tok
        self.name = name or str(getattr(tok, "name_or_path", "") or "tokenizer")
        template = chat_template if chat_template is not None else tok.chat_template
        if not isinstance(template, str) or not template:
            raise StageError(f"tokenizer {self.name!r} has no single chat template")
        self.template = template
        self.enable_thinking = enable_thinking
        self._render_jinja = render_jinja_template
        self._kwargs = {**tok.special_tokens_map, "enable_thinking": enable_thinking}
        try:  # the template compiled in apply_chat_template's sandbox, called directly
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled = _compile_jinja_template(template)
        except ImportError:  # a transformers without it: the public path, a bit slower
            self._compiled = None

        # Control tokens: every added token but whitespace-only ones (templates write "\n"
        # as text; such a token is found inside text by the tokenizer like any word).
        added = tok.added_tokens_decoder  # {id: AddedToken}
        self.control: dict[str, int] = {}
        flags = {}
        for i, t in sorted(added.items()):
            if t.content and not t.content.isspace() and t.content not in self.control:
                self.control[t.content] = i
                flags[t.content] = t
        if not self.control:
            raise StageError(f"tokenizer {self.name!r} has no control tokens")
        longest = sorted(self.control, key=len, reverse=True)
        # One capturing alternation keeps the regex engine's first-character scan.
        self._split_re = re.compile("(" + "|".join(map(re.escape, longest)) + ")")
        self._lstrip = {s for s in longest if flags[s].lstrip}
        self._rstrip = {s for s in longest if flags[s].rstrip}
        self.codec = ControlTokenCodec(longest, self.name)
        self._backend, self._added = tok.backend_tokenizer, added
        self._spelling = None  # _spelling_encoder(), made when a piece may need it
        self._nfc = is_nfc(self._backend.normalizer)

        self.generation_tags = bool(_GENERATION_TAG.search(template))
        chatml = IM_START in self.control and IM_END in self.control and IM_START in template
        if not self.generation_tags and not chatml:
            raise StageError(
                f"chat template of {self.name!r} is neither ChatML (<|im_start|>role ... "
                "<|im_end|>) nor marked with {% generation %} blocks, so the assistant's "
                "tokens cannot be found; give a template with generation blocks in "
                "tokenize.chat_template"
            )
        if not self.generation_tags:
            self.header, self.prefill = self._probe_generation_prompt()
        self.inline_thinking = self._moves_inline_thinking()
        self._self_test()

    # ---------------------------------------------------------------- encoders

    def _spelling_encoder(self):
        """The backend that encodes control-token spellings as text.

        `encode_special_tokens` (switched on around each call) covers special tokens
        only, so a tokenizer with non-special control tokens gets a copy marking them.
        """
        if self._spelling is not None:
            return self._spelling
        backend = self._backend
        if all(t.special for t in self._added.values() if t.content in self.control):
            self._spelling = backend
            return backend
        # the copy takes about a second (the whole tokenizer through JSON): made once per
        # tokenizer and control set in a process, shared as the backend itself would be
        key = (id(backend), tuple(sorted(self.control.items())))
        if key not in _SPELLING_COPIES:
            from tokenizers import Tokenizer

            text = backend.to_str()
            # only the added-token list is parsed and rewritten, not the vocabulary
            at = text.index("[", text.index('"added_tokens"'))
            entries, end = json.JSONDecoder().raw_decode(text, at)
            for entry in entries:
                if entry["content"] in self.control:
                    entry["special"] = True
            copy = Tokenizer.from_str(text[:at] + json.dumps(entries) + text[end:])
            _SPELLING_COPIES[key] = backend, copy  # the backend kept: its id() stays its own
        self._spelling = _SPELLING_COPIES[key][1]
        return self._spelling

    @property
    def spelling_copy_made(self) -> bool:
        """Whether this encoder has needed its tokenizer's copy for spellings yet."""
        return self._spelling is not None

    def encode_text(self, texts: Sequence[str], spelled: bool = True):
        """Encodings of plain text pieces: no control token parsed, nothing added.
        `spelled=False` promises that no piece spells a control token (a rendering cut at
        every control token it holds; stages/chat/controltext.py restores spellings only in
        look-alike rows)."""
        texts = list(texts)
        # An NFC normalizer leaves NFC text as it is, and nearly all text is NFC (ASCII
        # always is): it is then skipped, which saves ~8% of the encoding time (it
        # tracks the alignment of every character).
        skip = self._nfc and all(t.isascii() or unicodedata.is_normalized("NFC", t)
                                 for t in texts)
        # Text that spells no control token, as the normalizer leaves it, finds none: the
        # loaded backend encodes it as the spelling encoder would. (Text that is not NFC
        # can become a spelling once normalized: U+212A KELVIN SIGN is K.)
        loaded = not spelled and (skip or self._backend.normalizer is None)
        plain = self._backend if loaded else self._spelling_encoder()

        def encode():  # switched on the helper thread, where every encode of an encoder
            # runs (engine_ids too): before or after, never inside the switches
            old = plain.encode_special_tokens, plain.normalizer
            if not loaded:
                plain.encode_special_tokens = True
            if skip:
                plain.normalizer = None
            try:
                return plain.encode_batch_fast(texts, add_special_tokens=False)
            finally:
                plain.encode_special_tokens = old[0]
                if skip:
                    plain.normalizer = old[1]

        return off_main_thread(encode)

    # ------------------------------------------------------------- rendering

    def render(self, messages: list[dict], tools: list | None = None, *,
               add_generation_prompt: bool = False, with_spans: bool = False):
        """The template's text, as `apply_chat_template(..., tokenize=False)` renders it.

        With `with_spans`, returns (text, [(start, end) of each {% generation %} block]).
        """
        # as apply_chat_template does: keys whose value is None are dropped
        conv = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            if self._compiled is not None and not with_spans:
                # what render_jinja_template adds around the same call, minus its copies
                # of plain JSON data: reasoning also under every name templates read
                for i, m in enumerate(conv):
                    r = next((m[k] for k in _REASONING if m.get(k) is not None), None)
                    if r is not None:
                        conv[i] = {"thinking": r, **m, "reasoning_content": r}
                return self._compiled.render(
                    messages=conv, tools=tools or None, documents=None,
                    add_generation_prompt=add_generation_prompt, **self._kwargs)
            texts, spans = self._render_jinja(
                conversations=[conv],
                tools=tools or None,
                chat_template=self.template,
                return_assistant_tokens_mask=with_spans,
                add_generation_prompt=add_generation_prompt,
                **self._kwargs,
            )
        except StageError:
            raise
        except Exception as e:  # jinja raises many types; its message is what matters
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StageError(f"chat template of {self.name!r} failed: {msg}") from None
        if with_spans:
            return texts[0], [tuple(s) for s in spans[0]]
        return texts[0]

    def _probe_generation_prompt(self) -> tuple[str, str]:
        """Split the ChatML generation prompt into its header and what it prefills."""
        probe = [{"role": "user", "content": "x"}]
        bare = self.render(probe)
        with_prompt = self.render(probe, add_generation_prompt=True)
        suffix = with_prompt[len(bare):]
        if not with_prompt.startswith(bare):
            raise StageError(prefix_mismatch(self.name, with_prompt, bare))
        if not suffix.startswith(IM_START + "assistant"):
            raise StageError(
                f"chat template of {self.name!r} is not ChatML-like: its generation prompt "
                f"is {suffix!r}, not {IM_START}assistant..."
            )
        nl = suffix.find("\n")
        head = suffix if nl < 0 else suffix[: nl + 1]
        return head, suffix[len(head):]

    def _moves_inline_thinking(self) -> bool:
        """Whether the template moves thinking written inline in an assistant's content
        into its thinking block, as the Qwen formats do (stages/chat/thinking.py)."""
        written = "r" + thinking.CLOSE + "a"
        try:
            return written not in self.render([{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": written}])
        except StageError:
            return False

    def _self_test(self) -> None:
        """Encoding a rendering cut at its control tokens must give a whole-text encode's
        ids on a plain chat. (A row is also cut at the end of its generation prompt, so
        that the prompt has the ids the server encoded and the answer those of its own
        text: `<think>\n` + `\n</think>` there, where a whole encode merges `\n\n`.)"""
        probe = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Hello world, what is 2 + 2?"},
                 {"role": "assistant", "content": "It is 4."}]
        ours = self.encode_plans([self._cut(self.render(probe), 0, [], False)]).ids.tolist()
        whole = list(self.tok.apply_chat_template(
            probe, chat_template=self.template, tokenize=True, return_dict=False,
            enable_thinking=self.enable_thinking))
        if ours != whole:
            i = next((k for k, (a, b) in enumerate(zip(ours, whole)) if a != b),
                     min(len(ours), len(whole)))
            raise StageError(
                f"tokenizer {self.name!r}: encoding a rendering piece by piece does not give "
                f"the ids of a whole-text encode (first difference at token {i}: "
                f"{self.tok.decode(ours[i:i + 4])!r} vs {self.tok.decode(whole[i:i + 4])!r}); "
                "tokenizers that prefix every text piece with a space (SentencePiece "
                "Metaspace) are not supported"
            )

    # -------------------------------------------------------------- planning

    def plan(self, messages: list[dict], tools: list | None = None, *,
             policy: str = "last", truncated: bool = False,
             lookalikes: bool | None = None) -> list[RenderedRow]:
        """The rows of one conversation that ends with an assistant message.

        `lookalikes=False` promises that no string spells a control token (see
        `ControlTokenCodec.json_may_spell`); None looks.
        """
        if policy not in POLICIES:
            raise StageError(f"multi_turn policy {policy!r}: expected one of {POLICIES}")
        if not messages or messages[-1].get("role") != "assistant":
            raise StageError("the conversation does not end with an assistant message")
        messages = with_parsed_arguments(messages)
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if policy != "expand":
            conv = self._for_template(messages, tools, lookalikes, answer=True)
            return [self._plan_one(conv, len(turns), policy == "all", truncated)]
        rows = []
        for k, i in enumerate(turns, 1):
            conv = self._for_template(messages[: i + 1], tools, lookalikes, answer=True)
            last = truncated and i == len(messages) - 1
            rows.append(self._plan_one(conv, k, False, last))
        return rows

    def _for_template(self, messages: list[dict], tools: list | None,
                      lookalikes: bool | None = None, answer: bool = False) -> ForTemplate:
        """The messages and tools as the template gets them here: spellings swapped for
        sentinels when there are any (`lookalikes` says), thinking
        written inline in an assistant's content cut where the template cuts it
        (stages/chat/thinking.py), and with `answer` (the messages end with the answer a row
        trains on) and enable_thinking off, that answer taken as written after the
        generation prompt's closed, empty thinking block."""
        if answer and not self.enable_thinking:
            messages = messages[:-1] + [thinking.answered_after_closed_block(messages[-1])]
        inline = {}
        if self.inline_thinking and lookalikes is not False:
            inline = thinking.inline_parts(messages)
        look = lookalikes
        if look is None:  # the split `</think>` is the template's to read, not a look-alike
            view = [{**m, "content": list(inline[i])} if i in inline else m
                    for i, m in enumerate(messages)] if inline else messages
            look = self.codec.has_lookalikes(view, tools)
        if not look:
            return ForTemplate(messages, tools, False)
        tls = self.codec.sanitize(tools) if tools else tools
        return ForTemplate(self.codec.sanitize_messages(messages, inline), tls, True)

    def _plan_one(self, conv: ForTemplate, turn, all_turns, truncated) -> RenderedRow:
        msgs, tools = conv.messages, conv.tools
        if self.generation_tags:
            full, marked = self.render(msgs, tools, with_spans=True)
            prompt = self.render(msgs[:-1], tools, add_generation_prompt=True)
            if not full.startswith(prompt):
                raise StageError(prefix_mismatch(self.name, prompt, full))
            cut, spans = len(prompt), self._generation_spans(full, marked, len(prompt),
                                                             all_turns, truncated)
        else:
            full = self.render(msgs, tools)
            cut, spans = self._chatml_spans(full, all_turns, truncated)
        plan = self._cut(full, cut, spans, conv.lookalikes)
        plan.turn, plan.n_messages = turn, len(msgs)
        return plan

    def _generation_spans(self, full, marked, cut, all_turns, truncated):
        """The supervised spans of a template with `{% generation %}` blocks: its blocks
        from `cut` on (all of them with `all_turns`), where `cut`, the end of the
        generation prompt, comes from a second rendering with add_generation_prompt."""
        spans = [(max(s, cut) if s < cut < e else s, e) for s, e in marked if e > s]
        if not all_turns:
            spans = [(s, e) for s, e in spans if s >= cut]
        if not spans or spans[-1][0] < cut:
            raise StageError(
                f"chat template of {self.name!r} marks no {{% generation %}} block in the "
                "final assistant turn"
            )
        if truncated:  # the model stopped before the template's end-of-turn tokens
            s, e = spans[-1]
            spans[-1] = (s, self._strip_trailing_controls(full, s, e))
        return spans

    def _strip_trailing_controls(self, text: str, s: int, e: int) -> int:
        while True:
            tail = text[s:e].rstrip()
            for tok in self.control:
                if tail.endswith(tok):
                    e = s + len(tail) - len(tok)
                    break
            else:
                return e

    def _chatml_spans(self, full: str, all_turns: bool, truncated: bool):
        """The end of the generation prompt in a ChatML rendering, and its supervised
        spans: from there (the header `<|im_start|>assistant\\n` and what the template
        prefills: the Qwen3.6 format's `<think>\\n`, or its closed empty thinking block with
        enable_thinking=false) through the `<|im_end|>` that closes the turn, never the
        newline after it; a truncated answer's span stops before it (the model never wrote
        it). With `all_turns`, earlier assistant turns too, each from after its header (and
        the prefill, when the turn begins with it)."""
        header, prefill = self.header, self.prefill
        head_at = full.rfind(header)
        cut = head_at + len(header)
        if head_at < 0 or full.find(IM_START, cut) >= 0:
            raise StageError(
                f"chat template of {self.name!r} did not render the final assistant turn "
                f"as {header!r}...{IM_END}"
            )
        if not full.startswith(prefill, cut):
            got = full[cut:cut + len(prefill) + 20]
            raise StageError(
                f"the final assistant turn starts with {got!r}, but the generation prompt "
                f"(enable_thinking={self.enable_thinking}) ends with {prefill!r}: the "
                "completion was not generated with this prompt (check tokenize.enable_thinking)"
            )
        cut += len(prefill)
        end = full.find(IM_END, cut)
        if end < 0:
            raise StageError(f"chat template of {self.name!r} left the final turn open")
        spans = [(cut, end if truncated else end + len(IM_END))]
        if all_turns:
            earlier = []
            pos = full.find(header)
            while 0 <= pos < head_at:
                s = pos + len(header)
                if prefill and full.startswith(prefill, s):
                    s += len(prefill)
                e = full.find(IM_END, s)
                if e < 0 or e > head_at:
                    break
                earlier.append((s, e + len(IM_END)))
                pos = full.find(header, e)
            spans = earlier + spans
        return cut, spans

    def _cut(self, full: str, cut: int, spans, look: bool) -> RenderedRow:
        """`full` cut into parts at its control tokens, at `cut` and at the edges of
        `spans`. Cutting at control tokens gives the ids of a whole-text encode; cutting at
        the end of the generation prompt gives the prompt the ids the server saw, and the
        answer the ids of its own text (a whole-text encode could merge `assistant\\n`
        with an answer that starts with a newline)."""
        texts: list[str] = []
        parts: list[int | None] = []
        sup: list[bool] = []
        restore = self.codec.restore if look else None
        control = self.control
        # Cut points besides control tokens, and the supervised state after each.
        marks = sorted({cut, *(p for span in spans for p in span)})
        state = [any(s <= m < e for s, e in spans) for m in marks]
        sup_now = False  # spans never start before the first mark
        prompt_parts = -1
        pos = 0
        mi = 0

        def text(a: int, b: int) -> None:
            if b > a:
                t = full[a:b]
                texts.append(restore(t) if restore else t)
                parts.append(None)
                sup.append(sup_now)

        def advance(limit: int) -> None:
            nonlocal pos, mi, sup_now, prompt_parts
            while mi < len(marks) and marks[mi] <= limit:
                text(pos, marks[mi])
                pos = max(pos, marks[mi])
                sup_now = state[mi]
                if marks[mi] == cut:
                    prompt_parts = len(parts)
                mi += 1

        for m in self._split_re.finditer(full):
            a, b = m.span()
            name = m.group(1)
            if name in self._lstrip:  # the whitespace it absorbs is not encoded
                while a > pos and full[a - 1].isspace():
                    a -= 1
            if name in self._rstrip:
                while b < len(full) and full[b].isspace():
                    b += 1
            advance(m.start())
            text(pos, a)
            parts.append(control[name])
            sup.append(sup_now)
            pos = b
        advance(len(full))
        text(pos, len(full))
        return RenderedRow(0, 0, full, cut, texts, parts, sup,
                    prompt_parts if prompt_parts >= 0 else len(parts), look)

    # -------------------------------------------------------------- encoding

    def encode_plans(self, plans: Sequence[RenderedRow]) -> Batch:
        """Encode the text pieces of all plans in one call and assemble ids and masks."""
        encs = self.encode_text([t for p in plans for t in p.texts],
                                spelled=any(p.lookalikes for p in plans))
        flat: list[int] = []
        seg_len: list[int] = []
        seg_sup: list[bool] = []
        offsets = [0]
        prompt_lens = []
        j = 0
        for p in plans:
            n = 0
            prompt_len = -1
            for k, part in enumerate(p.parts):
                if k == p.prompt_parts:
                    prompt_len = n
                if part is None:
                    ids = encs[j].ids
                    j += 1
                    flat += ids
                    seg_len.append(len(ids))
                    n += len(ids)
                else:
                    flat.append(part)
                    seg_len.append(1)
                    n += 1
            seg_sup += p.sup
            offsets.append(offsets[-1] + n)
            prompt_lens.append(n if prompt_len < 0 else prompt_len)
        return Batch(
            np.array(flat, dtype=np.int32),
            np.repeat(np.array(seg_sup, dtype=np.int8), seg_len),
            np.array(offsets, dtype=np.int64),
            prompt_lens,
        )

    def encode(self, messages: list[dict], tools: list | None = None, *,
               policy: str = "last", truncated: bool = False) -> list[EncodedRow]:
        """Render and encode one conversation: its rows."""
        batch = self.encode_plans(self.plan(messages, tools, policy=policy, truncated=truncated))
        return [EncodedRow(*batch.row(i), batch.prompt_lens[i])
                for i in range(len(batch.prompt_lens))]

    # ---------------------------------------------------------- train/serve

    def engine_prompt(self, messages: list[dict], tools: list | None = None) -> str:
        """The text an engine renders for a chat request: messages as sent (tool-call
        arguments parsed, as engines do), the generation prompt, nothing sanitized."""
        return self.render(with_parsed_arguments(messages), tools, add_generation_prompt=True)

    def engine_ids(self, text: str) -> list[int]:
        """`text` encoded as an engine encodes a rendered chat: control tokens parsed."""
        return off_main_thread(self.tok.backend_tokenizer.encode, text,
                               add_special_tokens=False).ids

    def prompt_ids(self, messages: list[dict], tools: list | None = None, *,
                   engine_style: bool = False) -> np.ndarray:
        """Ids of `messages` rendered with the generation prompt, encoded as this encoder
        encodes a row's prompt; with `engine_style`, encoded whole with control tokens
        parsed, as an engine that does not sanitize message text encodes it."""
        if engine_style:
            return np.array(self.engine_ids(self.engine_prompt(messages, tools)), dtype=np.int32)
        conv = self._for_template(with_parsed_arguments(messages), tools)
        text = self.render(conv.messages, conv.tools, add_generation_prompt=True)
        return self.encode_plans([self._cut(text, len(text), [], conv.lookalikes)]).ids


def is_nfc(normalizer) -> bool:
    """Whether a tokenizer's normalizer is NFC alone (it then leaves NFC text as it is)."""
    from tokenizers import normalizers

    return isinstance(normalizer, normalizers.NFC)


def prefix_mismatch(name: str, prompt: str, full: str) -> str:
    i = 0
    n = min(len(prompt), len(full))
    while i < n and prompt[i] == full[i]:
        i += 1
    return (
        f"chat template of {name!r} renders the history differently with the generation "
        f"prompt than with the answer, at character {i}: prompt has "
        f"{prompt[max(0, i - 24):i + 24]!r}, full rendering has {full[max(0, i - 24):i + 24]!r}"
    )
