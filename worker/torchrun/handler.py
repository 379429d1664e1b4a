"""sarcomm as torchrun's rendezvous: torch's :class:`RendezvousHandler`, its contract kept exactly.

How torch's agent drives it (``torch/distributed/elastic/agent/server/api.py``):
``next_rendezvous()`` before it starts its workers, again after it stopped them; between the two,
every ``--monitor-interval`` (0.1 s), ``num_nodes_waiting()`` while its workers are healthy
(``> 0``: it stops them and re-rendezvouses, spending no restart), and, when a worker fails, a
restart (spending one of ``--max-restarts``) that re-rendezvouses too. Its launcher calls
``shutdown()`` when the node is done, but not when the agent dies of a signal.

What sarcomm does for each (one sarcomm member per node, the agent):

- ``next_rendezvous()`` joins the job (``--rdzv-id``) at the coordinator with ``--nnodes MIN:MAX``
  and blocks until a world forms; node rank and count come from the coordinator (host-contiguous,
  survivors keep their order). Every node holds a fresh, unused ``TCPStore`` server on a free port
  and joins with its port: node rank 0's becomes the generation's store (it listens already when
  the others connect; the next generation gets a new one), the others connect to it. The store
  is returned (torch's agents and, ``use_agent_store``, their workers use it; no key of an earlier
  generation is in it). The
  interface the coordinator chose, and ``SAR_COORD``/``SAR_JOB``/``SAR_GENERATION``, go into the
  environment the workers inherit, with ``SAR_ENDPOINTS_DIR``: the node's directory where the
  workers note their ``/metrics`` endpoints, which the heartbeats report (the coordinator's
  ``/sd`` lists every worker). A re-rendezvous re-joins with the node's member of the running
  generation, which ends that generation as a re-rendezvous (not a failure) for every node.
- ``num_nodes_waiting()`` answers from what the heartbeat stream brought: the nodes parked for the
  next generation (scale-up), or at least 1 once the generation ended (a node was lost, another
  node re-joins, the job failed): every surviving node hears that at once.
- ``set_closed()``/``is_closed()``: the job's rendezvous closes for every node (eventual, as
  torch documents); a later ``next_rendezvous()`` raises ``RendezvousClosedError``, and a node
  parked beyond MAX ``RendezvousGracefulExitError``.
- ``shutdown()`` leaves: with exit code 0 when the agent succeeded, the first failed worker's exit
  code when it failed (read from torch's ``ChildFailedError`` that the launcher is raising as it
  calls shutdown), 1 after any other error. A node leaving closes the rendezvous, as torch's own
  backends do; one leaving non-zero fails the job, and the other nodes hear it at once.

Errors are torch's types with sarcomm's messages: ``RendezvousTimeoutError`` (no world in
``join_timeout``), ``RendezvousConnectionError`` (coordinator or store unreachable, wrong token),
``RendezvousClosedError``, ``RendezvousGracefulExitError``, ``RendezvousError`` (a refusal).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from sarcomm.common import netinfo
from sarcomm.common.constants import (
    AUTO_METRICS_VARIABLE,
    COORD_VARIABLE,
    ENDPOINTS_DIR_VARIABLE,
    GENERATION_VARIABLE,
    INTERFACE_VARIABLES,
    JOB_VARIABLE,
    SOCKET_NAME_VARIABLE,
)
from sarcomm.common.errors import (
    CoordinatorUnavailableError,
    InvalidArgumentError,
    JobClosedError,
    JoinTimeoutError,
    SarcommError,
    UnauthenticatedError,
)
from sarcomm.common.messages import JoinResult
from sarcomm.worker.endpoints import clear_notes
from sarcomm.worker.launch_env import check_metrics_settings, socket_name_setting
from sarcomm.worker.torchrun.session import RendezvousSession
from sarcomm.worker.torchrun.settings import BACKEND, RendezvousSettings

__all__ = ["SarcommRendezvousHandler"]

log = logging.getLogger(__name__)

#: Where node rank 0's agent reaches its own store (the server listens on every interface).
_LOOPBACK = "127.0.0.1"


class SarcommRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on a sarcomm coordinator; see the module docstring."""

    def __init__(
        self,
        settings: RendezvousSettings,
        session: RendezvousSession,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self._settings = settings
        self._session = session
        # The agent's own environment: its workers inherit it (torch starts them with it).
        self._environ = os.environ if environ is None else environ
        # Interface variables the user set before torchrun: theirs wins (an NCCL_SOCKET_IFNAME for
        # InfiniBand, say); the coordinator's choice fills the others.
        self._user_set = frozenset(v for v in INTERFACE_VARIABLES if self._environ.get(v))
        self._result: JoinResult | None = None
        self._store: Store | None = None
        # A fresh store server, unused, ready for the generation in which this node is node rank 0.
        self._spare: TCPStore | None = None
        self._closed = ""
        self._left = False
        # Where this node's workers note their /metrics endpoints (SAR_ENDPOINTS_DIR), made at the
        # first rendezvous, emptied at each, removed at shutdown.
        self._endpoints: Path | None = None

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> SarcommRendezvousHandler:
        """The handler torchrun's parameters ask for.

        Raises:
            ValueError: a flag, ``--rdzv-conf`` key or ``SARCOMM_*`` variable breaks its rule (the
                message names it, its value and the rule).
        """
        try:
            settings = RendezvousSettings.from_parameters(params, os.environ)
            socket_name = socket_name_setting(os.environ)
            if socket_name:
                netinfo.check_socket_name(socket_name)
            # The workers inherit them: a malformed one is refused before any worker starts.
            check_metrics_settings(os.environ)
        except InvalidArgumentError as exc:
            raise ValueError(f"sarcomm rendezvous: {exc}") from None
        return cls(settings, RendezvousSession(settings, socket_name))

    def connect(self) -> None:
        """Reach the coordinator now, as the first ``next_rendezvous()`` does first: an endpoint
        with nothing listening, a wrong token or a TLS mismatch fails here, in seconds.

        Raises:
            RendezvousConnectionError: naming the cause.
        """
        with _torch_errors(self._settings.run_id):
            self._session.connect()
        if self._spare is None:
            self._spare = self._serve_store()

    # -- torch's contract ------------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """True: the workers use the agents' store (node rank 0's TCPStore, fresh each generation),
        at ``MASTER_ADDR``/``MASTER_PORT``."""
        return True

    def get_run_id(self) -> str:
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the job and block until a world with this node forms; see the module docstring.

        Raises:
            RendezvousClosedError: the job's rendezvous is closed.
            RendezvousGracefulExitError: it closed while this node was parked beyond MAX.
            RendezvousTimeoutError: no world formed within ``join_timeout``.
            RendezvousConnectionError: the coordinator (or node rank 0's store) is unreachable, or
                refused the token.
            RendezvousError: the coordinator refused the join (the message says why).
        """
        s = self._settings
        if self._closed:
            raise RendezvousClosedError(f"job {s.run_id}: the rendezvous is closed ({self._closed})")
        previous = self._result
        rejoin = None
        if previous is not None:
            member = previous.assignments[0]
            rejoin = (member.member_id, member.secret)
        self._session.stop_heartbeats()
        self._store = None  # the previous generation's store (its server, on node rank 0) goes
        self._clear_endpoints()  # the previous generation's workers are stopped
        server = self._spare if self._spare is not None else self._serve_store()
        with _torch_errors(s.run_id, s.join_timeout):
            result = self._session.join(server.port, rejoin)
        store: Store = server
        if result.assignments[0].rank == 0:
            self._spare = None  # used now: the next generation gets a fresh one
        else:
            store, self._spare = self._connect_store(result), server
        self._result, self._store = result, store
        self._export(result)
        self._session.watch(result, self._endpoints)
        node_rank = result.assignments[0].rank
        log.info(
            "job=%s node_rank=%d generation=%d: world of %d node(s) formed; store %s:%d; interface %s (%s)",
            result.job, node_rank, result.generation, result.world_size, result.master_addr,
            result.master_port, result.interface, result.address,
        )  # fmt: skip
        return RendezvousInfo(
            store, node_rank, result.world_size, RendezvousStoreInfo(result.master_addr, result.master_port)
        )

    def num_nodes_waiting(self) -> int:
        """Nodes that would join a re-formed world, from the heartbeat stream's last answers (no
        call to the coordinator): the parked ones, and at least 1 once this generation ended."""
        status = self._session.status
        if self._result is None or status.generation != self._result.generation:
            return 0
        return max(status.waiting, 1) if status.ended else status.waiting

    def is_closed(self) -> bool:
        return bool(self._closed) or self._session.status.closed

    def set_closed(self) -> None:
        """Close the job's rendezvous for every node (the coordinator tells the others)."""
        self._closed = self._closed or "set_closed() was called"
        if self._result is not None and not self._left:
            member = self._result.assignments[0]
            try:
                self._session.close_job(member.member_id, member.secret)
            except SarcommError as exc:
                raise RendezvousConnectionError(f"job {self._settings.run_id}: {exc}") from exc

    def shutdown(self) -> bool:
        """Leave the job (see the module docstring) and close the connection; True when the
        coordinator heard the leave (or there was nothing to leave).

        Never raises: torch's launcher calls it in a ``finally``, where an error of its own would
        hide the one the user needs (the ``ChildFailedError`` of a failed worker). What goes wrong
        (the coordinator unreachable, a call that does not end in time) is logged instead."""
        code, reason = _outcome(sys.exc_info()[1])
        heard = True
        try:
            if self._result is not None and not self._left:
                self._session.stop_heartbeats()
                member = self._result.assignments[0]
                self._left = True
                state = self._session.leave(member.member_id, member.secret, code, reason)
                log.info(
                    "job=%s node_rank=%d generation=%d: left with code %d; the job is %s",
                    self._result.job, member.rank, self._result.generation, code, state,
                )  # fmt: skip
        except (SarcommError, OSError) as exc:  # OSError: TimeoutError (the loop thread's deadline)
            run_id = self._settings.run_id
            log.warning("job=%s: could not report the node's end to the coordinator: %s", run_id, exc)
            heard = False
        self._store = self._spare = None
        try:
            self._session.close()
        except (SarcommError, OSError) as exc:
            log.warning("job=%s: closing the connection to the coordinator: %s", self._settings.run_id, exc)
        if self._endpoints is not None:
            shutil.rmtree(self._endpoints, ignore_errors=True)
        return heard

    # -- the store and the workers' environment ---------------------------------------------------

    def _serve_store(self) -> TCPStore:
        """A fresh TCPStore server on a free port (it listens on every interface), started before
        the join (at :meth:`connect`, then after each generation that used it): should this node
        become node rank 0, its store already listens when the others connect (a client that
        finds nothing there retries only after about half a second)."""
        try:
            return TCPStore(
                _LOOPBACK,
                0,
                is_master=True,
                timeout=timedelta(seconds=self._settings.read_timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, ValueError) as exc:
            raise RendezvousConnectionError(
                f"job {self._settings.run_id}: this node cannot serve a store: {exc}"
            ) from exc

    def _connect_store(self, result: JoinResult) -> Store:
        """The generation's store, served by node rank 0 (retrying until ``read_timeout``)."""
        try:
            return TCPStore(
                result.master_addr,
                result.master_port,
                is_master=False,
                timeout=timedelta(seconds=self._settings.read_timeout),
            )
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                f"job {result.job} generation {result.generation}: node rank {result.assignments[0].rank} "
                f"could not reach the store of node rank 0 at {result.master_addr}:{result.master_port} "
                f"within read_timeout {self._settings.read_timeout:g} s: {exc}"
            ) from exc

    def _clear_endpoints(self) -> None:
        """Make the node's endpoints directory, or empty it of the last workers' notes."""
        if self._endpoints is None:
            try:
                self._endpoints = Path(tempfile.mkdtemp(prefix=f"sarcomm-{self._settings.run_id}-"))
            except OSError as exc:  # the workers' endpoints go unlisted; the job runs
                log.warning(
                    "job=%s: no directory for the workers' /metrics endpoints: %s", self._settings.run_id, exc
                )
        else:
            clear_notes(self._endpoints)

    def _export(self, result: JoinResult) -> None:
        """What the workers read: the coordinator's interface and job (``sar.init()``, metrics),
        and where they note their ``/metrics`` endpoints (``/sd``)."""
        env = self._environ
        env.update(
            {
                COORD_VARIABLE: self._settings.endpoint,
                JOB_VARIABLE: result.job,
                GENERATION_VARIABLE: str(result.generation),
                SOCKET_NAME_VARIABLE: result.interface,
            }
        )
        if self._endpoints is not None:
            env[ENDPOINTS_DIR_VARIABLE] = str(self._endpoints)
        if not self._settings.auto_metrics:
            env[AUTO_METRICS_VARIABLE] = "0"
        env.update({name: result.interface for name in INTERFACE_VARIABLES if name not in self._user_set})


@contextmanager
def _torch_errors(run_id: str, join_timeout: float | None = None) -> Iterator[None]:
    """sarcomm's errors as torch's rendezvous errors, with sarcomm's messages; around a join,
    ``join_timeout`` is the node's (``--rdzv-conf join_timeout``)."""
    try:
        yield
    except JobClosedError as exc:
        if not exc.beyond_max:
            raise RendezvousClosedError(f"job {run_id}: {exc}") from exc
        # torch's agent logs a graceful exit at INFO only (and torch 2.13's launcher then fails on
        # the agent's empty result): say here, where it shows, why this node ends.
        log.warning("job=%s: %s; this node waited beyond --nnodes MAX and exits", run_id, exc)
        raise RendezvousGracefulExitError(f"job {run_id}: {exc}") from exc
    except JoinTimeoutError as exc:
        within = "" if join_timeout is None else f" within --rdzv-conf join_timeout={join_timeout:g} s"
        raise RendezvousTimeoutError(f"job {run_id}: no world formed{within}: {exc}") from exc
    except (CoordinatorUnavailableError, UnauthenticatedError, TimeoutError) as exc:
        raise RendezvousConnectionError(f"job {run_id}: {exc}") from exc
    except SarcommError as exc:
        raise RendezvousError(f"job {run_id}: {exc}") from exc


def _outcome(error: BaseException | None) -> tuple[int, str]:
    """The node's exit code and reason, from the exception torch's launcher is raising (if any)
    while it calls ``shutdown()``."""
    if error is None:
        return 0, ""
    if isinstance(error, ChildFailedError):
        rank, failure = error.get_first_failure()
        code = failure.exitcode if -255 <= failure.exitcode <= 255 else 1
        return code, f"worker (global rank {rank}) exited with code {failure.exitcode}"
    return 1, f"the agent stopped: {type(error).__name__}: {error}"[:512]
