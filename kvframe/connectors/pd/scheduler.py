"""The P/D connector's scheduler side: decides what moves; never touches KV memory.

On a producer (P) it turns requests that finished with ``do_remote_decode`` into lease grants
for the workers and ``kv_transfer_params`` for the router, and keeps their blocks until the
workers report the lease ended (``finished_sending``).

On a consumer (D) it tracks remote-prefill requests from the moment they arrive (heartbeats
start at once, and so does the handshake with their prefill engine), answers how many tokens
will be loaded, and turns allocations into load instructions.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd.auth import warn_unauthenticated
from kvframe.connectors.pd.metadata import (
    PDGrant,
    PDLoad,
    PDMetadata,
    PDPushProgress,
    PDPushSource,
    PDWorkerAddress,
    RemoteEngineAddr,
    RemoteRelease,
)
from kvframe.connectors.pd.options import PDOptions
from kvframe.connectors.pd.params import (
    PushPrefillParams,
    RemotePrefillParams,
    decode_engine_of,
    history_of,
    prompt_digest,
    push_id_of,
    transfer_mode,
    wants_keep,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvframe.core.blocksize import block_size_problem
from kvframe.core.heartbeat import HeartbeatTracker, StopReason
from kvframe.core.lease import LeasePolicy
from kvframe.core.requests import (
    DECODE_REQUEST_TRANSITIONS,
    DecodeRequestEvent,
    DecodeRequestState,
)
from kvframe.core.tp import check_tp_pair
from kvframe.errors import CodecError, ConfigError
from kvframe.protocol.codec import Codec
from kvframe.protocol.messages import ConnectorOutput, KVEvent, Stats
from kvframe.spi.connector import EngineInfo, KVConnectorScheduler, SchedulerStep
from kvframe.spi.request import BlockIds, RequestView

__all__ = ["PDConnectorScheduler"]

_NORMAL_FINISH = frozenset({"stop", "length"})
#: Request ids whose kv_transfer_params were refused, remembered so each is counted once.
_REMEMBER_REJECTED = 4096


@attrs.define(eq=False)
class _Incoming:
    """A remote-prefill request on D."""

    params: RemotePrefillParams | PushPrefillParams
    addr: RemoteEngineAddr
    state: DecodeRequestState = DecodeRequestState.WAITING
    history: bool = False
    """Bidirectional mode: P pulls a conversation's history from the decoder that kept it."""

    def move(self, event: DecodeRequestEvent, request_id: str) -> None:
        self.state = DECODE_REQUEST_TRANSITIONS.next(self.state, event, request_id)


def _remote_addr(params: RemotePrefillParams | PushPrefillParams) -> RemoteEngineAddr:
    """The engine a ticket names (where its KV is)."""
    return RemoteEngineAddr(
        engine_id=params.remote_engine_id,
        host=params.remote_host,
        port=params.remote_port,
        ports=params.remote_ports,
        tp_size=params.tp_size,
    )


class _HistoryRefused(ConfigError):
    """P refuses a ``kv_history`` whose ticket passed its checks (signature, engine, shape) but
    that this prompt cannot use (another prefix, too few tokens): the decoder that kept the
    turn is told to free it at once."""

    def __init__(self, message: str, params: RemotePrefillParams) -> None:
        super().__init__(message)
        self.addr = _remote_addr(params)
        self.remote_request_id = params.remote_request_id


class PDConnectorScheduler(KVConnectorScheduler):
    """Scheduler half of :class:`~kvframe.connectors.pd.PDConnector`."""

    def __init__(
        self, config: KVTransferConfig, engine: EngineInfo, options: PDOptions, *, codec: Codec
    ) -> None:
        if config.engine_id is None:
            raise ConfigError(
                "engine_id is required by PDConnector: P names itself to D with it, and D "
                "tells prefill engines apart by it"
            )
        self._config = config
        self._codec = codec
        self._engine = engine
        self._options = options
        if options.keys is None:
            warn_unauthenticated("scheduler")
        self._engine_id: str = config.engine_id
        self._policy = LeasePolicy.from_duration(config.kv_lease_duration)
        self._ttl = options.decoder_ttl(config.decoder_kv_blocks_ttl)
        self._tracker = HeartbeatTracker.from_policy(self._policy)
        self._now = 0.0
        self._stepped = False
        self._ports: dict[int, int] = {}
        # P side
        self._grants: list[PDGrant] = []
        self._held: dict[str, str] = {}  # local request id -> lease id (push: push id)
        self._push_sources: list[PDPushSource] = []
        self._push_abandoned: list[str] = []
        # push_layerwise: push-mode requests being prefilled -> (push id, prompt tokens,
        # digest, their blocks so far)
        self._push_live: dict[str, tuple[str, int, str, list[list[int]]]] = {}
        self._incarnations: dict[int, str] = {}
        # D, bidirectional mode: requests whose blocks are kept for a next turn, oldest first
        # (local request id -> (lease id, blocks)), and the lease ids to give back now.
        self._kept: dict[str, tuple[str, int]] = {}
        self._evictions: list[str] = []
        # The workers' latest "leases_active" gauge (leases held but unclaimed kept turns).
        self._leases_active = 0
        # D side
        self._incoming: dict[str, _Incoming] = {}
        self._loads: list[PDLoad] = []
        self._releases: list[RemoteRelease] = []
        self._aborts: set[str] = set()
        self._new_engines: dict[str, RemoteEngineAddr] = {}
        self._confirm: dict[str, dict[str, None]] = {}  # engine -> lease ids to confirm now
        self._rejected: dict[str, None] = {}
        # The last view check_request accepted, with its parameters (see check_request).
        self._checked: tuple[RequestView, RemotePrefillParams | PushPrefillParams] | None = None
        self._events: list[KVEvent] = []
        self._counters: dict[str, int] = {}

    # -- helpers -------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _parse(self, request: RequestView) -> _Incoming | None:
        inc = self._incoming.get(request.request_id)
        if inc is not None:
            return inc
        params_in = request.kv_transfer_params
        history = bool(params_in) and params_in is not None and "kv_history" in params_in
        if not history and not (self._config.is_consumer and wants_remote_prefill(params_in)):
            return None
        if request.request_id in self._rejected:
            return None  # refused once already (and counted then): prefilled locally
        assert request.kv_transfer_params is not None
        try:
            checked = self._checked
            self._checked = None
            if checked is not None and checked[0] is request:
                params = checked[1]
            else:
                params = self._validated(request)
        except ConfigError as exc:
            # The request is still served, by local prefill: correct, only slower.
            self._settled(request.request_id)
            if isinstance(exc, _HistoryRefused):
                # An authentic ticket this prompt cannot use: the decoder may free the kept
                # turn now instead of holding it for decoder_kv_blocks_ttl.
                self._new_engines.setdefault(exc.addr.engine_id, exc.addr)
                self._releases.append(
                    RemoteRelease(remote=exc.addr, remote_request_id=exc.remote_request_id)
                )
                self._count("history_released")
            kind = "history_refused" if history else "bad_params"
            self._count(kind)
            self._events.append(
                KVEvent(
                    kind=f"pd.{kind}",
                    data={"request_id": request.request_id, "error": str(exc)},
                )
            )
            return None
        addr = _remote_addr(params)
        inc = _Incoming(params=params, addr=addr, history=history)
        self._incoming[request.request_id] = inc
        return inc

    def _settled(self, request_id: str) -> None:
        # Never parse this request's kv_transfer_params again (refused, or served locally).
        self._rejected[request_id] = None
        if len(self._rejected) > _REMEMBER_REJECTED:
            del self._rejected[next(iter(self._rejected))]

    def _validated(self, request: RequestView) -> RemotePrefillParams | PushPrefillParams:
        assert request.kv_transfer_params is not None
        if "kv_history" in request.kv_transfer_params:
            return self._validated_history(request)
        if transfer_mode(request.kv_transfer_params) == "push":
            return self._validated_push(request)
        return self._validated_pull(request)

    def _validated_history(self, request: RequestView) -> RemotePrefillParams:
        # P, bidirectional mode: the decoder's ticket of the conversation so far. Pulled only
        # when it is a kept-blocks ticket of this engine's fleet, the new prompt really starts
        # with the tokens it covers, and they are at least kv_recompute_threshold.
        history = history_of(request.kv_transfer_params)
        assert history is not None
        if not self._config.is_consumer:
            raise ConfigError(
                f"kv_transfer_params.kv_history: engine {self._engine_id!r} has kv_role "
                f"{self._config.kv_role!r} and cannot pull a conversation's history; give "
                "prefill engines of multi-turn conversations kv_role kv_both"
            )
        params = RemotePrefillParams.from_dict(history)
        if params.kept_until is None:
            raise ConfigError(
                "kv_transfer_params.kv_history has no kept_until: it is not a decoder's "
                "kept-blocks ticket; pass the kv_transfer_params the decode engine returned "
                "for the conversation's previous turn, unchanged"
            )
        self._check_ticket(params, "kv_transfer_params.kv_history.")
        mine = prompt_digest(request.prompt_token_ids, params.remote_num_tokens)
        if not request.prompt_token_ids or mine != params.remote_prompt_digest:
            raise _HistoryRefused(
                f"kv_transfer_params.kv_history covers {params.remote_num_tokens} tokens but "
                "this prompt does not start with them (a client or a reasoning model that "
                "rewrote the conversation, or another conversation's history): recomputed",
                params,
            )
        loadable = self._loadable(request, params)
        threshold = self._options.kv_recompute_threshold
        if loadable < threshold or loadable <= 0:
            raise _HistoryRefused(
                f"kv_transfer_params.kv_history shares {loadable} tokens with this prompt, "
                f"fewer than kv_recompute_threshold ({threshold}): recomputed",
                params,
            )
        self._check_blocks(params, loadable, "kv_transfer_params.kv_history.")
        return params

    def _validated_push(self, request: RequestView) -> PushPrefillParams:
        # P checks the prompt (against the registration) and the handshake checks P's identity
        # against the fleet key: only the address and its shape are checked here.
        assert request.kv_transfer_params is not None
        params = PushPrefillParams.from_dict(request.kv_transfer_params)
        self._check_peer(params.transport, params.tp_size, params.remote_ports, "push")
        if self._options.keys is not None and not request.prompt_token_ids:
            raise ConfigError(
                "this engine has a fleet key but gives its connector no prompt token ids "
                "(RequestView.prompt_token_ids), so the prefill engine cannot check that it "
                "pushes this request's prompt"
            )
        return params

    def _check_peer(
        self, transport: str, tp_size: int, ports: tuple[int, ...], mode: str = "pull"
    ) -> None:
        if transport != self._options.transport:
            raise ConfigError(
                f"kv_transfer_params.transport = {transport!r} but this engine "
                f"uses {self._options.transport!r}; both engines must use one transport"
            )
        mine = self._engine.world_size
        if tp_size != mine:
            heads = self._engine.num_kv_heads
            if mode != "pull":
                raise ConfigError(
                    f"kv_transfer_params.tp_size = {tp_size} but this engine has {mine} "
                    f"workers; heterogeneous tensor parallelism is supported in pull mode "
                    f"only, not in {mode} mode: run both engines at one size, or pull"
                )
            if heads is None:
                raise ConfigError(
                    f"kv_transfer_params.tp_size = {tp_size} but this engine has {mine} "
                    "workers; heterogeneous tensor parallelism needs the engine to give its "
                    "connector the model's KV-head count (EngineInfo.num_kv_heads)"
                )
            try:
                check_tp_pair(tp_size, mine, heads)
            except ValueError as exc:
                raise ConfigError(f"kv_transfer_params.tp_size = {tp_size}: {exc}") from None
        if ports and len(ports) != tp_size:
            raise ConfigError(
                f"kv_transfer_params.remote_ports has {len(ports)} ports for "
                f"tp_size {tp_size}; expected one per rank"
            )

    def _validated_pull(self, request: RequestView) -> RemotePrefillParams:
        # Every check before anything is allocated or any peer contacted: the ticket first (a
        # forged or altered one names nothing), then the fields against this engine's limits.
        assert request.kv_transfer_params is not None
        params = RemotePrefillParams.from_dict(request.kv_transfer_params)
        self._check_ticket(params, "kv_transfer_params.")
        if params.remote_num_tokens > request.num_prompt_tokens:
            raise ConfigError(
                f"kv_transfer_params.remote_num_tokens = {params.remote_num_tokens} but the "
                f"prompt has {request.num_prompt_tokens} tokens; P computed another prompt"
            )
        self._check_prompt(request, params)
        self._check_blocks(params, self._loadable(request, params), "kv_transfer_params.")
        return params

    def _check_ticket(self, params: RemotePrefillParams, where: str) -> None:
        # The signature first (a forged or altered ticket names nothing), then its engine.
        if self._options.keys is not None:
            params.verify(self._options.keys)
        history = where != "kv_transfer_params."
        self._check_peer(
            params.transport,
            params.tp_size,
            params.remote_ports,
            "bidirectional (kv_history)" if history else "pull",
        )
        if len(params.remote_block_ids) != self._engine.num_kv_groups:
            raise ConfigError(
                f"{where}remote_block_ids has {len(params.remote_block_ids)} KV groups; this "
                f"engine has {self._engine.num_kv_groups}"
            )

    def _check_blocks(self, params: RemotePrefillParams, loadable: int, where: str) -> None:
        # The ticket's blocks are of P's block size (remote_block_size; absent: this engine's).
        # Sizes that cannot be regrouped are refused here, before anything is allocated.
        mine = self._engine.block_size
        theirs = params.remote_block_size or mine
        order = "NHD" if self._engine.num_kv_heads is not None else "block-major"
        why = block_size_problem(mine, theirs, order, order)
        if why is None and theirs != mine:
            if where != "kv_transfer_params.":
                why = (
                    f"this engine's blocks hold {mine} tokens; blocks of another size are "
                    "regrouped in pull mode only, not for a kv_history: run both engines at one "
                    "block size"
                )
            elif self._engine.num_kv_groups != 1:
                why = (
                    f"this engine's blocks hold {mine} tokens; blocks of another size are "
                    f"regrouped for one KV group only, this engine has "
                    f"{self._engine.num_kv_groups}: run both engines at one block size"
                )
        if why is not None:
            raise ConfigError(f"{where}remote_block_size = {theirs}: {why}")
        need = math.ceil(loadable / theirs)
        most = math.ceil(params.remote_num_tokens / theirs) + 1
        said = (
            f"the prefill engine's block size of {theirs} tokens ({where}remote_block_size)"
            if params.remote_block_size
            else f"this engine's block size of {mine} tokens (the ticket names no "
            "remote_block_size: the prefill engine's blocks must be as large; pass P's "
            "kv_transfer_params through unchanged)"
        )
        for g, group in enumerate(params.remote_block_ids):
            if not need <= len(group) <= most:
                raise ConfigError(
                    f"{where}remote_block_ids[{g}] has {len(group)} blocks; {need} to {most} "
                    f"are expected for {params.remote_num_tokens} tokens at {said}"
                )

    def _check_prompt(self, request: RequestView, params: RemotePrefillParams) -> None:
        # The KV is of P's prompt: load it only into a request with the same prompt (a ticket
        # of another request would otherwise put another prompt's KV under this one's hashes).
        keyed = self._options.keys is not None
        if not params.remote_prompt_digest:
            if keyed:
                raise ConfigError(
                    "kv_transfer_params.remote_prompt_digest is missing but this engine has a "
                    "fleet key: the prefill engine must give its connector the prompt's token "
                    "ids (RequestView.prompt_token_ids) so its tickets name their prompt"
                )
            return
        if not request.prompt_token_ids:
            if keyed:
                raise ConfigError(
                    "this engine gives its connector no prompt token ids "
                    "(RequestView.prompt_token_ids), so it cannot check which prompt "
                    "kv_transfer_params.remote_prompt_digest names"
                )
            return
        mine = prompt_digest(request.prompt_token_ids, params.remote_num_tokens)
        if mine != params.remote_prompt_digest:
            raise ConfigError(
                "kv_transfer_params.remote_prompt_digest names another prompt than this "
                "request's: the KV is of another request (pass each request its own "
                "kv_transfer_params)"
            )

    def check_request(self, request: RequestView) -> None:
        """Raise :class:`~kvframe.errors.ConfigError` for a remote-prefill request whose
        ``kv_transfer_params`` this engine refuses (a missing, forged or altered ticket when a
        fleet key is configured, a field out of bounds, another transport or tensor-parallel
        size, block lists that do not fit the prompt). Changes nothing the connector does;
        the view it accepted is remembered, so ``on_new_request`` with that same view does not
        verify the ticket and hash the prompt again."""
        if self._config.is_consumer and wants_remote_prefill(request.kv_transfer_params):
            self._checked = (request, self._validated(request))

    def _time(self, request: RequestView) -> float:
        # The latest step's clock; before the first step, the request's arrival time (both on
        # the engine's clock). Never max() the two: an engine may leave arrival_time at 0.
        return self._now if self._stepped else request.arrival_time

    def _loadable(
        self, request: RequestView, params: RemotePrefillParams | PushPrefillParams
    ) -> int:
        # The engine must compute at least the last prompt token itself (it needs its logits).
        if isinstance(params, PushPrefillParams):
            return max(0, request.num_prompt_tokens - 1)
        return max(0, min(params.remote_num_tokens, request.num_prompt_tokens - 1))

    def _release(self, inc: _Incoming) -> None:
        if isinstance(inc.params, PushPrefillParams):
            return  # P heard nothing from us: its KV waits wait_timeout, then is freed
        self._releases.append(
            RemoteRelease(remote=inc.addr, remote_request_id=inc.params.remote_request_id)
        )

    # -- SPI -----------------------------------------------------------------------------
    def on_new_request(self, request: RequestView) -> None:
        """D: start heartbeating for a remote-prefill request now (it may wait in the queue
        longer than a lease), and start the handshake with its prefill engine. P, push mode
        with ``push_layerwise``: follow the request's prefill step by step."""
        if (
            self._options.push_layerwise
            and self._config.is_producer
            and wants_remote_decode(request.kv_transfer_params)
        ):
            assert request.kv_transfer_params is not None
            try:
                if transfer_mode(request.kv_transfer_params) == "push":
                    n = request.num_prompt_tokens
                    self._push_live[request.request_id] = (
                        push_id_of(request.kv_transfer_params),
                        n,
                        prompt_digest(request.prompt_token_ids, n) or "",
                        [],
                    )
            except ConfigError:
                pass  # request_finished refuses it and says why
        inc = self._parse(request)
        if inc is None:
            return
        self._start_tracking(request, inc)
        self._count("remote_requests")

    def _start_tracking(self, request: RequestView, inc: _Incoming) -> None:
        self._new_engines[inc.addr.engine_id] = inc.addr
        if isinstance(inc.params, PushPrefillParams):
            return  # push: D holds the lease, P heartbeats it (the handshake starts now)
        waiting = inc.state is DecodeRequestState.WAITING
        if inc.history and waiting and not self._options.symmetric_leases:
            return  # bidirectional without symmetric leases: heartbeats from allocation
        # Heartbeat the lease from now on, and once at once: D reads only under a lease P
        # confirmed, and the first confirmation should be back before the load is allocated.
        self._tracker.track(
            request.request_id,
            inc.addr.engine_id,
            inc.params.remote_request_id,
            self._time(request),
        )
        self._confirm.setdefault(inc.addr.engine_id, {})[inc.params.remote_request_id] = None

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        inc = self._parse(request)
        if inc is None or inc.state is not DecodeRequestState.WAITING:
            return 0, False
        external = self._loadable(request, inc.params) - num_computed_tokens
        if external <= 0:
            # Everything is in the local prefix cache: tell P to free at once.
            self._finish_incoming(request.request_id, DecodeRequestEvent.LOCAL_HIT)
            self._settled(request.request_id)
            self._count("full_local_hits")
            return 0, False
        threshold = self._options.kv_recompute_threshold
        if inc.history and external < threshold:
            # This engine's own prefix cache has most of the history: the rest costs less to
            # compute than a pull's round trips. The decoder may free its blocks at once.
            self._finish_incoming(request.request_id, DecodeRequestEvent.LOCAL_HIT)
            self._settled(request.request_id)
            self._count("history_refused")
            self._events.append(
                KVEvent(
                    kind="pd.history_refused",
                    data={
                        "request_id": request.request_id,
                        "error": f"only {external} tokens of kv_history are not in this "
                        f"engine's prefix cache, fewer than kv_recompute_threshold "
                        f"({threshold}): recomputed",
                    },
                )
            )
            return 0, False
        pull = not isinstance(inc.params, PushPrefillParams)
        if pull and not self._tracker.tracked(request.request_id):
            self._start_tracking(request, inc)  # a history without symmetric leases: no-op
        return external, True

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        inc = self._incoming.get(request.request_id)
        if inc is None or inc.state is not DecodeRequestState.WAITING:
            return
        if num_external_tokens <= 0:
            self._finish_incoming(request.request_id, DecodeRequestEvent.LOCAL_HIT)
            return
        bs = self._engine.block_size
        first = request.num_computed_tokens // bs
        last = math.ceil((request.num_computed_tokens + num_external_tokens) / bs)
        local = tuple(tuple(group[first:last]) for group in blocks)
        if isinstance(inc.params, PushPrefillParams):
            if any(len(g) != last - first for g in local):
                raise ValueError(
                    f"request {request.request_id!r}: the engine allocated "
                    f"{[len(g) for g in blocks]} blocks for {num_external_tokens} external "
                    f"tokens after {request.num_computed_tokens} computed; blocks "
                    f"{first}..{last} are needed"
                )
            n = request.num_prompt_tokens
            inc.move(DecodeRequestEvent.ALLOCATED, request.request_id)
            self._loads.append(
                PDLoad(
                    request_id=request.request_id,
                    remote=inc.addr,
                    remote_request_id=inc.params.push_id,
                    local_block_ids=local,
                    remote_block_ids=tuple(() for _ in local),
                    remote_incarnations=inc.params.remote_incarnations,
                    push_id=inc.params.push_id,
                    first_block=first,
                    num_tokens=n,
                    prompt_digest=prompt_digest(request.prompt_token_ids, n) or "",
                )
            )
            return
        theirs = inc.params.remote_block_size
        if theirs and theirs != bs:
            # Blocks of another size (checked to regroup, _check_blocks): P's blocks that hold
            # the loaded tokens, which the worker regroups into these (kvframe.core.blocksize).
            start = request.num_computed_tokens
            stop = start + num_external_tokens
            rfirst, rlast = start // theirs, math.ceil(stop / theirs)
            remote = tuple(tuple(g[rfirst:rlast]) for g in inc.params.remote_block_ids)
            if any(len(g) != last - first for g in local) or any(
                len(g) != rlast - rfirst for g in remote
            ):
                raise ValueError(
                    f"request {request.request_id!r}: the engine allocated "
                    f"{[len(g) for g in blocks]} blocks for {num_external_tokens} external "
                    f"tokens after {request.num_computed_tokens} computed; blocks "
                    f"{first}..{last} are needed"
                )
            self._add_pull_load(
                request,
                inc,
                local,
                remote,
                remote_block_size=theirs,
                token_range=(start, stop),
            )
            return
        remote = tuple(tuple(group[first:last]) for group in inc.params.remote_block_ids)
        if any(len(lg) != len(rg) for lg, rg in zip(local, remote, strict=True)):
            raise ValueError(
                f"request {request.request_id!r}: the engine allocated "
                f"{[len(g) for g in blocks]} blocks for {num_external_tokens} external tokens "
                f"after {request.num_computed_tokens} computed; blocks {first}..{last} are needed"
            )
        self._add_pull_load(
            request, inc, local, remote, remote_block_size=inc.params.remote_block_size
        )

    def _add_pull_load(
        self,
        request: RequestView,
        inc: _Incoming,
        local: BlockIds,
        remote: BlockIds,
        *,
        remote_block_size: int = 0,
        token_range: tuple[int, int] = (0, 0),
    ) -> None:
        assert isinstance(inc.params, RemotePrefillParams)
        inc.move(DecodeRequestEvent.ALLOCATED, request.request_id)
        if not self._tracker.tracked(request.request_id):
            self._start_tracking(request, inc)  # heartbeats from now, the first at once
        if inc.history:
            self._count("history_loads")
        self._loads.append(
            PDLoad(
                request_id=request.request_id,
                remote=inc.addr,
                remote_request_id=inc.params.remote_request_id,
                local_block_ids=local,
                remote_block_ids=remote,
                remote_incarnations=inc.params.remote_incarnations,
                kept_until=inc.params.kept_until,
                remote_block_size=remote_block_size,
                load_start=token_range[0],
                load_stop=token_range[1],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> PDMetadata:
        now = scheduler_output.now
        self._now = now if not self._stepped else max(self._now, now)
        self._stepped = True
        # One batch per remote engine: the schedule's due batch and the new leases to confirm.
        heartbeats: dict[str, dict[str, None]] = {}
        for batch in self._tracker.due(now):
            heartbeats.setdefault(batch.engine_id, {}).update(dict.fromkeys(batch.request_ids))
        for engine_id, ids in self._confirm.items():
            heartbeats.setdefault(engine_id, {}).update(ids)
        self._confirm.clear()
        progress = self._push_progress(scheduler_output) if self._push_live else ()
        meta = PDMetadata(
            push_progress=progress,
            step=scheduler_output.step,
            now=now,
            grants=tuple(self._grants),
            evictions=tuple(self._evictions),
            push_sources=tuple(self._push_sources),
            push_abandoned=tuple(self._push_abandoned),
            abort_request_ids=frozenset(self._aborts),
            pd_heartbeats={e: tuple(ids) for e, ids in heartbeats.items()},
            pd_loads=tuple(self._loads),
            releases=tuple(self._releases),
            engines=tuple(self._new_engines.values()),
        )
        self._grants.clear()
        self._evictions.clear()
        self._push_sources.clear()
        self._push_abandoned.clear()
        self._aborts.clear()
        self._loads.clear()
        self._releases.clear()
        self._new_engines.clear()
        if heartbeats:
            self._count("heartbeat_batches", len(heartbeats))
        return meta

    def _push_progress(self, step: SchedulerStep) -> tuple[PDPushProgress, ...]:
        out = []
        for rid, (push_id, n, digest, blocks) in self._push_live.items():
            new = step.new_block_ids.get(rid)
            if rid in step.new_requests:
                blocks[:] = [list(g) for g in new] if new is not None else []
            elif rid in step.cached_requests and new is not None:
                if not blocks:
                    blocks[:] = [[] for _ in new]
                for have, more in zip(blocks, new, strict=False):
                    have.extend(more)
            else:
                continue
            computed = step.num_computed_tokens.get(rid)
            if computed is None or not blocks:
                continue  # the engine does not report it: the whole KV is pushed at the end
            out.append(
                PDPushProgress(
                    request_id=rid,
                    push_id=push_id,
                    block_ids=tuple(tuple(g) for g in blocks),
                    computed_tokens=min(computed, n),
                    num_tokens=n,
                    prompt_digest=digest,
                )
            )
        return tuple(out)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        active = output.stats.gauges.get("leases_active")
        if active is not None:
            self._leases_active = int(active)
        for rid in output.finished_recving:
            inc = self._incoming.get(rid)
            if inc is not None and inc.state in (
                DecodeRequestState.LOADING,
                DecodeRequestState.ABORTING,
            ):
                self._finish_incoming(rid, DecodeRequestEvent.LOAD_STOPPED)
        for rid in output.finished_sending:
            self._held.pop(rid, None)
            self._kept.pop(rid, None)
        if output.failures:
            self._count("load_failures", len(output.failures))

    def _finish_incoming(
        self, request_id: str, event: DecodeRequestEvent, reason: StopReason | None = None
    ) -> None:
        inc = self._incoming.pop(request_id)
        was = inc.state
        inc.move(event, request_id)
        if reason is None:
            reason = (
                StopReason.ABORTED
                if event is DecodeRequestEvent.FINISHED
                else StopReason.TRANSFER_DONE
            )
        self._tracker.stop(request_id, self._now, reason)
        if was is DecodeRequestState.WAITING:
            # No load was ever posted: P may free at once.
            self._release(inc)

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._rejected.pop(rid, None)
        self._push_live.pop(rid, None)
        inc = self._incoming.get(rid)
        if inc is not None:
            aborted = request.finish_reason not in _NORMAL_FINISH
            reason = StopReason.ABORTED if aborted else StopReason.FINISHED
            if inc.state is DecodeRequestState.LOADING:
                # A transfer may still write into these blocks: the workers stop it, release
                # the lease and report the request in finished_recving; the engine keeps the
                # blocks until then (an async load's blocks are never freed before that).
                inc.move(DecodeRequestEvent.FINISHED, rid)
                self._tracker.stop(rid, self._now, reason)
                self._aborts.add(rid)
                return False, None
            if inc.state is DecodeRequestState.ABORTING:
                return False, None
            self._finish_incoming(rid, DecodeRequestEvent.FINISHED, reason)
            # On: a decoder may keep the request's KV for the next turn, and a prefill engine
            # that pulled a conversation's history keeps its KV for its decoder.
        if wants_keep(request.kv_transfer_params):
            return self._keep_finished(request, block_ids)
        if not (self._config.is_producer and wants_remote_decode(request.kv_transfer_params)):
            return False, None
        assert request.kv_transfer_params is not None
        try:
            mode = transfer_mode(request.kv_transfer_params)
            push_id = push_id_of(request.kv_transfer_params) if mode == "push" else ""
            decoder = decode_engine_of(request.kv_transfer_params)
        except ConfigError as exc:
            self._count("remote_decode_not_kept")
            self._events.append(
                KVEvent(kind="pd.not_kept", data={"request_id": rid, "error": str(exc)})
            )
            return False, None
        if push_id:
            return self._push_finished(request, push_id, block_ids)
        if request.finish_reason not in _NORMAL_FINISH or not any(block_ids):
            self._count("remote_decode_not_kept")
            return False, None
        # The lease id is a capability of its own, not derived from the request id: 128 random
        # bits (forged notices name nothing) in 32 characters, whatever the request id's length.
        lease_id = secrets.token_hex(16)
        try:
            params = self._params_for(request, lease_id, block_ids)
        except ConfigError as exc:
            # Never raise out of request_finished: the blocks are freed now, the router gets
            # no ticket and D prefills the request itself.
            self._count("remote_decode_not_kept")
            self._events.append(
                KVEvent(kind="pd.not_kept", data={"request_id": rid, "error": str(exc)})
            )
            return False, None
        self._grants.append(
            PDGrant(request_id=rid, lease_id=lease_id, block_ids=block_ids, decode_engine=decoder)
        )
        self._held[rid] = lease_id
        self._count("leases_offered")
        return True, params

    def _keep_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        # D, bidirectional mode: keep the conversation's KV (prompt and answer) for its next
        # turn under a kept lease, and hand the router a ticket of it.
        rid = request.request_id
        why = ""
        if not self._config.is_producer:
            why = (
                f"kv_role {self._config.kv_role!r} cannot keep KV for a next turn (it serves no "
                "reads); give decode engines of multi-turn conversations kv_role kv_both"
            )
        elif request.finish_reason not in _NORMAL_FINISH or not any(block_ids):
            why = f"the request ended with {request.finish_reason!r}"
        elif not request.prompt_token_ids or not request.output_token_ids:
            why = (
                "the engine gives its connector no token ids (RequestView.prompt_token_ids and "
                "output_token_ids), so the kept KV could not name its tokens"
            )
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        # The last generated token never went through the model: its KV does not exist.
        n = min(len(tokens) - 1, min(len(g) for g in block_ids) * self._engine.block_size)
        if not why and n <= 0:
            why = "no token has KV"
        if why:
            self._count("history_not_kept")
            self._events.append(
                KVEvent(kind="pd.history_not_kept", data={"request_id": rid, "error": why})
            )
            return False, None
        lease_id = secrets.token_hex(16)
        ttl = self._ttl.ttl
        try:
            params = self._params_for(
                request,
                lease_id,
                block_ids,
                num_tokens=n,
                digest=prompt_digest(tokens, n) or "",
                kept_ttl=ttl,
            )
        except ConfigError as exc:
            self._count("history_not_kept")
            self._events.append(
                KVEvent(kind="pd.history_not_kept", data={"request_id": rid, "error": str(exc)})
            )
            return False, None
        self._grants.append(
            PDGrant(request_id=rid, lease_id=lease_id, block_ids=block_ids, ttl=ttl)
        )
        self._held[rid] = lease_id
        self._kept[rid] = (lease_id, sum(len(g) for g in block_ids))
        self._count("history_kept")
        return True, params

    def reclaim_blocks(self, num_blocks: int, now: float) -> int:
        """D, bidirectional mode: give back blocks kept for conversations' next turns, the
        oldest turn first, until ``num_blocks`` are covered. A kept lease nobody claimed ends
        in the workers' next step; one a prefill engine claimed is revoked (it ends when that
        engine's read completes or stops, or one extension after its last heartbeat). The
        prefill engine is told ``ABORTED`` and recomputes."""
        given = 0
        for rid in list(self._kept):
            if given >= num_blocks:
                break
            lease_id, n = self._kept.pop(rid)
            self._evictions.append(lease_id)
            given += n
            self._count("kept_evicted")
        return given

    def _push_finished(
        self, request: RequestView, push_id: str, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        # The workers write the blocks to the decoder that registers push_id, then report the
        # request in finished_sending; the blocks are kept until then.
        rid = request.request_id
        answer: dict[str, Any] = {"transfer_mode": "push", "push_id": push_id}
        if request.finish_reason not in _NORMAL_FINISH or not any(block_ids):
            self._push_abandoned.append(push_id)
            self._count("remote_decode_not_kept")
            return False, answer
        n = request.num_prompt_tokens
        self._push_sources.append(
            PDPushSource(
                request_id=rid,
                push_id=push_id,
                block_ids=block_ids,
                num_tokens=n,
                prompt_digest=prompt_digest(request.prompt_token_ids, n) or "",
            )
        )
        self._held[rid] = push_id
        self._count("push_offered")
        return True, answer

    def kv_address(self) -> dict[str, Any]:
        """P's address for push-mode decode legs: the ``kv_transfer_params`` fields that name
        this engine (``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_ports``,
        ``remote_incarnations``, ``tp_size``, ``transport``). A router adds
        ``do_remote_prefill``, ``transfer_mode: "push"`` and the request's ``push_id``.

        :raises ConfigError: a decode-only engine (it has none), or the engine never forwarded
            its workers' handshake metadata and the side-channel port is 0 (the address is
            not known).
        """
        if not self._config.is_producer:
            raise ConfigError(
                f"engine {self._engine_id!r} is a decode-only engine (kv_role "
                f"{self._config.kv_role!r}): it has no push address; ask a prefill engine "
                "(kv_producer or kv_both)"
            )
        ports, base = self._side_channel()
        out: dict[str, Any] = {
            "remote_engine_id": self._engine_id,
            "remote_host": self._options.side_channel_host,
            "remote_port": ports[0] if ports else base,
            "tp_size": self._engine.world_size,
            "transport": self._options.transport,
        }
        if ports and base == 0:
            out["remote_ports"] = list(ports)
        if len(self._incarnations) == self._engine.world_size:
            out["remote_incarnations"] = [self._incarnations[r] for r in sorted(self._incarnations)]
        return out

    def _params_for(
        self,
        request: RequestView,
        lease_id: str,
        block_ids: BlockIds,
        *,
        num_tokens: int | None = None,
        digest: str | None = None,
        kept_ttl: float | None = None,
    ) -> dict[str, Any]:
        ports, base = self._side_channel()
        n = request.num_prompt_tokens if num_tokens is None else num_tokens
        if digest is None:
            digest = prompt_digest(request.prompt_token_ids, n) or ""
        life = self._policy.duration if kept_ttl is None else kept_ttl
        params = RemotePrefillParams(
            remote_engine_id=self._engine_id,
            remote_request_id=lease_id,
            remote_host=self._options.side_channel_host,
            remote_port=ports[0] if ports else base,
            remote_ports=ports if ports and base == 0 else (),
            remote_incarnations=tuple(self._incarnations[r] for r in sorted(self._incarnations))
            if len(self._incarnations) == self._engine.world_size
            else (),
            remote_block_ids=block_ids,
            remote_num_tokens=n,
            remote_block_size=self._engine.block_size,
            remote_prompt_digest=digest,
            tp_size=self._engine.world_size,
            transport=self._options.transport,
            lease_duration=self._policy.duration,
            # An estimate (the worker grants as of its own, later, clock reading): a reader
            # never reads on it, but for kept blocks (kept_until) maps it through its clock
            # offset estimate and reads only before the result, which is early, never late.
            lease_expires_at=self._now + life,
            kept_until=None if kept_ttl is None else self._now + life,
            kept_ttl=kept_ttl,
        )
        if self._options.keys is not None:
            params = params.signed(self._options.keys)
        return params.to_dict()

    def _side_channel(self) -> tuple[tuple[int, ...], int]:
        # The workers' ports (rank order) and the configured base port; ConfigError when
        # neither says where P listens.
        ports = tuple(self._ports[r] for r in sorted(self._ports))
        base = self._options.side_channel_port
        if base == 0 and not ports:
            raise ConfigError(
                "kv_connector_extra_config.side_channel_port is 0 (a free port per worker) but "
                "the engine never called set_xfer_handshake_metadata(); give a fixed port or "
                "forward the workers' handshake metadata"
            )
        return ports, base

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, bytes]) -> None:
        for rank, blob in metadata.items():
            try:
                address = self._codec.decode_as(bytes(blob), PDWorkerAddress)
            except (CodecError, TypeError) as exc:
                raise ConfigError(
                    f"worker {rank} sent malformed handshake metadata ({exc}); pass each "
                    "worker's get_handshake_metadata() bytes through unchanged"
                ) from exc
            self._ports[int(rank)] = address.port
            self._incarnations[int(rank)] = address.incarnation

    def has_pending_work(self) -> bool:
        return bool(
            self._held
            or self._incoming
            or self._evictions
            or self._grants
            or self._push_sources
            or self._push_abandoned
            or self._loads
            or self._releases
            or self._aborts
            or self._confirm
            or len(self._tracker)
        )

    def next_deadline(self) -> float | None:
        """When the engine must step again (engine clock). At once (``-inf``) while P holds
        leases (heartbeats must be answered within milliseconds), while D has loads in flight
        or instructions to pass on. When the only leases held are a decoder's kept turns
        that no prefill engine has claimed (bidirectional mode; the workers report the others
        in their ``leases_active`` gauge), ``kept_poll_interval`` after the latest step: a
        next turn's first heartbeat waits at most that long for the answer, and from the
        claim on the engine steps at once again. Otherwise, with only queued remote-prefill
        requests on D, when their next heartbeat batch is due; ``None`` with nothing to do."""
        loading = any(
            inc.state is not DecodeRequestState.WAITING for inc in self._incoming.values()
        )
        if (
            loading
            or self._evictions
            or self._grants
            or self._push_sources
            or self._push_abandoned
            or self._loads
            or self._releases
            or self._aborts
            or self._confirm
            or (self._held and (len(self._kept) < len(self._held) or self._leases_active > 0))
        ):
            return -math.inf
        due = self._tracker.next_deadline()
        if self._held:
            poll = self._now + self._options.kept_poll_interval
            return poll if due is None else min(due, poll)
        return due

    def get_stats(self) -> Stats:
        counters = dict(self._counters)
        self._counters.clear()
        return Stats(
            counters=counters,
            gauges={
                "scheduler_leases_held": len(self._held),
                "scheduler_kept": len(self._kept),
                "scheduler_remote_requests": len(self._incoming),
            },
        )

    def take_events(self) -> tuple[KVEvent, ...]:
        out = tuple(self._events)
        self._events.clear()
        return out

    def shutdown(self) -> None:
        self._push_live.clear()
        self._kept.clear()
        self._incoming.clear()
        self._held.clear()
