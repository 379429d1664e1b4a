"""The library training code imports: ``import sarcomm.worker as sar`` gives these names, loading
this package (and torch) on first use.

- :mod:`.registration`, :mod:`.startup`: joining the coordinator (``coord_ip_init``, ``init``).
- :mod:`.comm`, :mod:`.backends`: the process group, SAR's ``initialize_comms`` and getters.
- :mod:`.collectives`: every collective, timed (:mod:`.collectives.timing`) into :mod:`.metrics`.
- :mod:`.services`: heartbeats and peer-failure delivery from inside a rank.
- :mod:`.lifecycle`, :mod:`.teardown`: leaving and exiting without hanging.
- :mod:`.sar_compat`, :mod:`.sar_keywords`, :mod:`.task_thread`: SAR's remaining names.
- :mod:`.bench_rank`: the rank side of ``sar-worker bench``.
"""

# The public API, listed once: ``sarcomm.worker`` forwards every name below (and SAR's ``comm``).
from sarcomm.common.client.coordinator_client import CoordinatorClient as CoordinatorClient
from sarcomm.common.errors import PeerFailedError as PeerFailedError
from sarcomm.common.errors import SarcommError as SarcommError
from sarcomm.common.messages import Assignment as Assignment
from sarcomm.common.tls import ClientTls as ClientTls
from sarcomm.worker.library import comm as comm
from sarcomm.worker.library.collectives import all_gather as all_gather
from sarcomm.worker.library.collectives import all_reduce as all_reduce
from sarcomm.worker.library.collectives import all_to_all as all_to_all
from sarcomm.worker.library.collectives import all_to_all_config as all_to_all_config
from sarcomm.worker.library.collectives import barrier as barrier
from sarcomm.worker.library.collectives import broadcast as broadcast
from sarcomm.worker.library.collectives import configure_all_to_all as configure_all_to_all
from sarcomm.worker.library.collectives import exchange_tensors as exchange_tensors
from sarcomm.worker.library.collectives import gather as gather
from sarcomm.worker.library.collectives import gather_grads as gather_grads
from sarcomm.worker.library.collectives import recv as recv
from sarcomm.worker.library.collectives import reduce as reduce
from sarcomm.worker.library.collectives import reduce_scatter as reduce_scatter
from sarcomm.worker.library.collectives import scatter as scatter
from sarcomm.worker.library.collectives import send as send
from sarcomm.worker.library.collectives import sync_params as sync_params
from sarcomm.worker.library.comm import backend as backend
from sarcomm.worker.library.comm import comm_device as comm_device
from sarcomm.worker.library.comm import initialize_comms as initialize_comms
from sarcomm.worker.library.comm import is_initialized as is_initialized
from sarcomm.worker.library.comm import master_ip as master_ip
from sarcomm.worker.library.comm import master_port as master_port
from sarcomm.worker.library.comm import rank as rank
from sarcomm.worker.library.comm import world_size as world_size
from sarcomm.worker.library.lifecycle import finalize as finalize
from sarcomm.worker.library.registration import coord_ip_init as coord_ip_init
from sarcomm.worker.library.sar_compat import exchange_single_tensor as exchange_single_tensor
from sarcomm.worker.library.sar_compat import nfs_ip_init as nfs_ip_init
from sarcomm.worker.library.startup import WorkerInfo as WorkerInfo
from sarcomm.worker.library.startup import init as init
from sarcomm.worker.library.task_thread import CommThread as CommThread
from sarcomm.worker.library.task_thread import comm_thread as comm_thread
