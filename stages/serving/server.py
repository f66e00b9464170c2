"""The server a generate run talks to: URLs it is given, or an engine it launches.

`ServerHandle(cfg, key, redact)` is `generate.server` as a run uses it: the URLs, the
engine, the model name that keys the cache (`resolve_label`), whether the seed is
honoured, whether a URL is a router. `async with handle.running(tools) as urls:` waits
for the URL servers, or starts the engine (stopped when the block ends); inside it,
`budget()` says how max_tokens is fitted into the served context and `watchdog()` what
watches the server while requests are sent. `check_server` checks the params first.
docs/stages.md, generate, "Server", "Readiness", "Seed" and "Watchdog".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit

from stages.common import params, secrets
from stages.common.errors import StageError
from stages.common.secrets import Redactor, strip_url_credentials, url_credentials
from stages.serving import engineflags, fitting, probes
from stages.serving.engines import EngineProcess
from stages.serving.watchdog import UrlWatchdog, Watchdog

log = logging.getLogger(__name__)

SERVER_LOG = Path(".cache/logs/generate-server.log")


def check_server(s: params.Server) -> None:
    """StageError naming the param when `generate.server` cannot work as given."""
    if (s.url is None) == (s.launch is None):
        raise StageError(
            "generate.server: set exactly one of generate.server.url (a running server) "
            "or generate.server.launch (a server this stage starts)"
        )
    if isinstance(s.url, list) and not s.url:
        raise StageError("generate.server.url: empty list (give at least one URL)")
    for u in server_urls(s):
        shown = strip_url_credentials(u)
        if not u.startswith(("http://", "https://")):
            raise StageError(f"generate.server.url: {shown!r} is not an http(s):// URL")
        try:  # a bad port or no host would only show as an unreachable server, much later
            parts = urlsplit(u)
            if parts.port == 0 or not parts.hostname:
                raise ValueError("no host or port 0")
        except ValueError as e:
            raise StageError(f"generate.server.url: {shown!r} is not a valid URL ({e})") from None
        if s.api_key_env and any(url_credentials(u)):
            raise StageError(
                "generate.server.url: has credentials (user:password@) and "
                "generate.server.api_key_env is set too; a request carries one "
                "Authorization header: use one of them"
            )


def server_urls(server: params.Server) -> list[str]:
    """generate.server.url as a list (empty for a launched server)."""
    return [server.url] if isinstance(server.url, str) else list(server.url or [])


def launch_secrets(server: params.Server) -> list[str]:
    """The values of secret flags in a launched engine's args or command (its admin key,
    a Hub token): masked wherever they show up, the engine's own log included."""
    launch = server.launch
    if launch is None:
        return []
    return secrets.flag_secrets([*launch.args, *(launch.command or [])])


def api_key(server: params.Server) -> Optional[str]:
    """The API key from the environment variable `server.api_key_env` names, or None."""
    if not server.api_key_env:
        return None
    key = os.environ.get(server.api_key_env)
    if not key:
        raise StageError(
            f"generate.server.api_key_env: environment variable {server.api_key_env} is not set"
        )
    return secrets.check_key(key, f"generate.server.api_key_env: {server.api_key_env}")


class ServerHandle:
    """The server this run talks to (launched or at URLs): its URLs, the model name, the
    engine process once launched. Its params are `params.Server`."""

    def __init__(self, cfg: params.Generate, key: Optional[str], redact: Redactor):
        self.cfg = cfg
        self.key = key
        self.redact = redact
        self.launched: Optional[EngineProcess] = None
        self.urls: list[str] = []
        self.live: list[str] = []  # where requests go, once `running`
        s = cfg.server
        if s.launch is not None:
            self.engine = s.launch.engine
            self.label = s.model or s.launch.model
        else:
            self.urls = [probes.normalize_url(u) for u in server_urls(s)]  # credentials kept: used
            self.engine = s.engine or "sglang"
            self.label = s.model  # None: asked from the server
        self.request_model = s.model

    async def resolve_label(self) -> str:
        """The model name that keys the cache (a URL server without server.model is asked,
        once it is ready)."""
        if self.label is None:
            served = await self.ready()
            if served is None:
                raise StageError(
                    f"{self.shown_urls()[0]}/v1/models lists no model: set generate.server.model "
                    "(it is sent with every request and keys the request cache)"
                )
            self.request_model = served
            self.label = self.redact(served)  # written into every row
        return self.label

    async def ready(self) -> Optional[str]:
        return await probes.wait_ready(self.urls, self.cfg.server.unreachable_deadline, self.key)

    def shown_urls(self) -> list[str]:
        return [strip_url_credentials(u) for u in self.urls]

    async def seed_used(self) -> Optional[bool]:
        """Whether the server honours generate.seed (None: no seed, or cannot tell); says so
        when it does not. The seed keys the request cache either way: it is what was asked."""
        if self.cfg.seed is None:
            return None
        used = await asyncio.to_thread(probes.seed_honoured, *self._setup_source())
        if used is False:
            log.warning(
                "generate.seed=%s is ignored: SGLang uses a request's seed only when started "
                "with %s; replies are sampled anew on a re-send (the cache keeps them stable)",
                self.cfg.seed, probes.DETERMINISTIC_FLAG,
            )  # fmt: skip
        return used

    async def reasoning_split(self) -> bool:
        """Whether each reply comes with its thinking already cut out of `content` by the
        engine's reasoning parser, so that the client must not cut it again: an empty
        thinking comes back as null, and an answer that writes `</think>` itself would
        lose its first part (SGLang also needs `separate_reasoning` on)."""
        if self.engine == "sglang" and not self.cfg.separate_reasoning:
            return False
        return await asyncio.to_thread(probes.reasoning_split, *self._setup_source())

    def _setup_source(self) -> tuple:
        """(engine, url, key, argv) for the probes that read a server's setup: a launched
        engine's from its argv, a URL server's from the server."""
        launch = self.cfg.server.launch
        argv = None if launch is None else list(launch.args) + list(launch.command or [])
        return self.engine, self.urls[0] if self.urls else None, self.key, argv

    async def behind_router(self) -> bool:
        """Whether the URL server is an sglang-router (a warning for each param the run
        misses behind it); False for a launched engine."""
        if not self.urls:
            return False
        return await asyncio.to_thread(
            engineflags.behind_router, self.cfg, self.urls, self.shown_urls(), self.key)

    @contextlib.asynccontextmanager
    async def running(self, tools: bool) -> AsyncIterator[list[str]]:
        """The URLs to send to, once the server is ready: a URL server is waited for (a
        router with no worker answers 503); an engine is launched with the flags prompts
        with `tools` need, and stopped when the block ends."""
        s = self.cfg.server
        if s.launch is None:
            await self.ready()
            self.live = self.urls
            yield self.live
            return
        self.launched = EngineProcess(engineflags.launch_for(s.launch, tools), SERVER_LOG, self.key)
        try:
            # in a thread: an engine can take minutes to start and Ctrl-C must still work
            await asyncio.to_thread(self.launched.start)
            self.request_model = s.model or self.launched.model_name
            self.live = [self.launched.url]
            yield self.live
        except StageError as e:
            if str(SERVER_LOG) in str(e):
                raise
            raise StageError(f"{e} (server log: {SERVER_LOG})") from None
        finally:
            self.launched.stop()

    async def budget(self) -> Optional[fitting.ContextBudget]:
        """How this run fits max_tokens into the served context (serving/fitting.py), or None."""
        cfg = self.cfg
        context = cfg.context_length
        if context is None and cfg.tokenizer is not None:
            context = await asyncio.to_thread(probes.served_context, self.live,
                                              self.request_model, self.key)
        return await asyncio.to_thread(fitting.budget, context, cfg.max_tokens,
                                       cfg.min_new_tokens, cfg.tokenizer, cfg.enable_thinking,
                                       self.engine)

    def watchdog(self) -> Watchdog | UrlWatchdog:
        """What watches the running server: a launched engine is restarted when it hangs,
        a hung URL server ends the run."""
        s = self.cfg.server
        if self.launched is not None:
            return Watchdog(self.launched, s.watchdog_seconds, s.max_restarts,
                            self.cfg.request_timeout)
        model = self.request_model or ""
        watched = [probes.GenerationProbe(u, self.engine, model, self.key) for u in self.urls]
        return UrlWatchdog(watched, self.shown_urls(), s, self.cfg.request_timeout)

    def info(self) -> dict:
        launch = self.cfg.server.launch
        if self.launched is not None:
            info = dict(self.launched.info())
        elif launch is not None:  # every answer came from the cache: nothing was started
            info = {"engine": self.engine, "model": launch.model, "started": False,
                    "args": secrets.redact_args(launch.args),
                    "command": secrets.redact_args(launch.command) if launch.command else None,
                    "version": None}
        else:
            info = {"urls": self.shown_urls(), "engine": self.engine}
        return self.redact.scrub(info)
