"""The engine's own token ids: asking for them, reading them from a reply, and what a
completion row keeps of them.

SGLang (`return_prompt_token_ids`, `return_token_ids`) and vLLM (`return_token_ids`) send,
when asked, the ids they fed the model and the ids it generated; sglang-router drops
both switches, and `why_without` says so. A completion row keeps them whole,

    "engine_tokens": {"prompt_ids": [...], "completion_ids": [...] or null}

or `{"unusable": why, "problem": kind}` for ids that are not a list of token ids (an
`Unusable`: its kind says whether tokenize refuses the row), or the digest form of
vLLM's ids that cached replies may hold. Asking for ids changes no request-cache key.
Where each engine puts them, and how tokenize checks and trains on them: docs/stages.md
(generate, "Client"; tokenize, "Serve-render check" and "Engine-exact rows").
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import numpy as np

from stages.chat.conversation import token_ids_digest

ROUTER_WHY = ("sglang-router drops return_prompt_token_ids and return_token_ids from "
              "every request it forwards: prompts are checked by token count")
NOT_ASKED_WHY = "{engine} returns no token ids: prompts are checked by token count"
MISSING_WHY = ("the engine sent no token ids (an engine that does not know the switch, or "
               "replies cached before they were asked for): those prompts are checked by "
               "token count")
DIGEST_KEYS = {"prompt_sha256", "prompt", "completion"}


def request_fields(engine: str) -> dict:
    """The fields that ask `engine` for its token ids (none for `transformers serve`,
    which refuses unknown fields)."""
    if engine == "sglang":
        return {"return_prompt_token_ids": True, "return_token_ids": True}
    if engine == "vllm":
        return {"return_token_ids": True}
    return {}


def why_without(engine: str, router: bool) -> str:
    """Why rows of this run may carry no engine ids: what the report and log say."""
    if router:
        return ROUTER_WHY
    if not request_fields(engine):
        return NOT_ASKED_WHY.format(engine=engine)
    return MISSING_WHY


def engine_of(data: Any, asked: Optional[str]) -> Optional[str]:
    """The engine that answered the parsed reply `data`, where its ids say so (SGLang
    puts both in the choice, vLLM the prompt's at the top and `token_ids`); else `asked`,
    the run's `server.engine`. A row written from a cached reply follows the engine that
    served it, not the one a later run names."""
    choice = (data.get("choices") or [{}])[0] if isinstance(data, dict) else {}
    if not isinstance(choice, dict):
        return asked
    if "response_token_ids" in choice or "prompt_token_ids" in choice:
        return "sglang"
    if "token_ids" in choice or "prompt_token_ids" in data:
        return "vllm"
    return asked


def from_reply(data: Any) -> Optional[dict]:
    """What a completion row keeps of the engine's ids in the parsed reply `data` (see the
    module docstring); None when the reply carries none."""
    if "engine_tokens" in data:  # a reply cached by an earlier run, ids already reduced
        kept = data["engine_tokens"]
        return kept if digest_problem(kept) is None else MALFORMED_DIGEST.kept()
    choice = data["choices"][0]
    prompt = choice.get("prompt_token_ids", data.get("prompt_token_ids"))
    completion = choice.get("response_token_ids", choice.get("token_ids"))
    if prompt is None and completion is None:
        return None
    why = ids_problem(prompt, "prompt_token_ids", allow_empty=False)
    if why is None and completion is not None:
        why = ids_problem(completion, "the completion's token ids", allow_empty=True)
    if why:
        return why.kept()
    return {"prompt_ids": prompt, "completion_ids": completion}


class Problem(enum.Enum):
    """What makes engine ids unusable, as a completion row records it (`problem`)."""

    NOT_A_LIST = "not_a_list"
    EMPTY = "empty"
    NOT_IDS = "not_ids"  # a list holding something other than integers
    NOT_AN_ID = "not_an_id"  # an integer no token id can be (negative, past 2**32)
    MALFORMED_DIGEST = "malformed_digest"
    UNNAMED = "unnamed"  # a reason that came without its problem (by hand, an older generate)


@dataclasses.dataclass(frozen=True)
class Unusable:
    """Why a row's engine ids cannot be used: the phrase the report and errors show, and
    its kind, which callers ask (`bad_values`) instead of reading the phrase."""

    why: str
    problem: Problem

    def __str__(self) -> str:
        return self.why

    @property
    def bad_values(self) -> bool:
        """The ids hold values that are no token ids: no engine serves those (a damaged
        file, a server that is no engine), so tokenize refuses the row. An empty or absent
        list is only unusable: the row is checked by the count the engine reported."""
        return self.problem in (Problem.NOT_IDS, Problem.NOT_AN_ID)

    def kept(self) -> dict:
        """What a completion row keeps as its `engine_tokens`."""
        return {"unusable": self.why, "problem": self.problem.value}

    @classmethod
    def read(cls, kept: dict) -> "Unusable":
        """A row's `{"unusable": why, "problem": kind}`, as read back from disk (a kind
        that is missing or unknown is UNNAMED: counted as unusable, never refused)."""
        problem = kept.get("problem")
        known = {p.value for p in Problem}
        return cls(str(kept["unusable"])[:200],
                   Problem(problem) if problem in known else Problem.UNNAMED)


MALFORMED_DIGEST = Unusable("a malformed digest", Problem.MALFORMED_DIGEST)


def ids_problem(ids: Any, what: str, allow_empty: bool) -> Optional[Unusable]:
    """Why `ids` is not a list of token ids (`what` names it in the phrase), or None."""
    return token_array(ids, what, allow_empty)[1]


def token_array(ids: Any, what: str, allow_empty: bool) -> tuple[Optional[np.ndarray],
                                                                 Optional[Unusable]]:
    """(`ids` as an int64 array, None), or (None, why it is not a list of token ids)."""
    if not isinstance(ids, list):
        return None, Unusable(f"{what} is not a list", Problem.NOT_A_LIST)
    if not ids:
        return (np.zeros(0, np.int64), None) if allow_empty else \
            (None, Unusable(f"{what} is empty", Problem.EMPTY))
    if set(map(type, ids)) != {int}:  # a JSON true would pass as 1 in numpy
        return None, Unusable(f"{what} is not a list of token ids", Problem.NOT_IDS)
    try:
        a = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        a = None
    if a is None or a.min() < 0 or a.max() >= 1 << 32:
        return None, Unusable(f"{what} holds a number that is not a token id", Problem.NOT_AN_ID)
    return a, None


def digest_problem(kept: Any) -> Optional[str]:
    """Why a digest-form `engine_tokens` (read back from disk) is not well formed, or None."""
    ok = (isinstance(kept, dict) and set(kept) == DIGEST_KEYS
          and isinstance(kept["prompt_sha256"], str) and type(kept["prompt"]) is int
          and (kept["completion"] is None or type(kept["completion"]) is int))
    return None if ok else "not a digest of token ids"


class Served:
    """What a completion row says the engine served: its prompt ids, or their digest and
    count, its completion ids or count, or why there are none (`fallback`)."""

    def __init__(self, row: dict):
        served = row.get("engine_tokens")
        usage = row.get("usage") if isinstance(row.get("usage"), dict) else {}
        self.prompt_ids: Optional[np.ndarray] = None
        self.completion_ids: Optional[np.ndarray] = None
        self.digest: Optional[str] = None
        self.unusable: Optional[Unusable] = None
        n_prompt = n_completion = None
        if isinstance(served, dict) and "prompt_ids" in served:
            prompt, why = token_array(served["prompt_ids"], "prompt_ids", allow_empty=False)
            completion = served.get("completion_ids")
            if why is None and completion is not None:
                completion, why = token_array(completion, "completion_ids", allow_empty=True)
            if why:
                self.unusable = why
            else:
                self.prompt_ids, self.completion_ids = prompt, completion
                n_prompt = len(prompt)
                n_completion = None if completion is None else len(completion)
        elif isinstance(served, dict) and "unusable" in served:
            self.unusable = Unusable.read(served)
        elif served is not None:
            if digest_problem(served) is None:
                self.digest, n_prompt, n_completion = (served["prompt_sha256"], served["prompt"],
                                                       served["completion"])
            else:
                self.unusable = MALFORMED_DIGEST
        self.by_ids = self.prompt_ids is not None or self.digest is not None
        self.n_prompt = n_prompt if self.by_ids else _count(usage.get("prompt_tokens"))
        if n_completion is None:
            n_completion = _count(usage.get("completion_tokens"))
        self.n_completion = n_completion

    def prompt_agrees(self, ours: Optional[np.ndarray]) -> bool:
        """Whether our prompt ids are the ones served (by ids, digest or count)."""
        if ours is None or len(ours) != self.n_prompt:
            return False
        if self.prompt_ids is not None:
            return bool(np.array_equal(ours, self.prompt_ids))
        return self.digest is None or token_ids_digest(ours) == self.digest


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None
