"""What a rank's environment says, read in one place: the launchers' variables (``sar-worker``,
torchrun, Open MPI, MPICH/PMI, Slurm) and the ``SAR_*``/``SARCOMM_*`` settings a rank reads, as
pure functions of a mapping that validate their values (messages name the variable, the value and
the rule), and what the worker side writes into the environment.

- :mod:`~sarcomm.worker.launch_env.launchers`: who started this process, as which rank
  (:func:`parse_launch_env`, :func:`slurm_task`).
- :mod:`~sarcomm.worker.launch_env.settings`: one function per setting, read when the call that
  needs it runs, so that an explicit argument wins without the variable being judged.
- :mod:`~sarcomm.worker.launch_env.environ`: :func:`process_environ`, the only access to
  ``os.environ`` on the rank side, and the variables a member is given (:func:`member_environment`).

The library modules read no variable themselves: their entry points (``init``, ``coord_ip_init``,
``initialize_comms``, ``start_rank_services``, ``nfs_ip_init``, the exit hook) take the mapping
from :func:`process_environ` and pass it, or what is parsed from it, down. Every variable's name is
defined once, in :mod:`sarcomm.common.constants` (the launchers' own in ``launchers``);
``tests/test_env_reads.py`` holds both rules.

Imports neither torch nor the library: the agent side uses it too.
"""

from sarcomm.worker.launch_env.environ import master_environment, member_environment, process_environ
from sarcomm.worker.launch_env.launchers import (
    LaunchEnv,
    SlurmTask,
    check_backend,
    detect_launcher,
    parse_launch_env,
    slurm_task,
)
from sarcomm.worker.launch_env.settings import (
    ALL_INTERFACES,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_EXIT_TIMEOUT_S,
    ProgressSettings,
    RankIdentity,
    RegistrationSettings,
    agent_pid_setting,
    backend_setting,
    check_metrics_settings,
    client_tls_setting,
    collective_timeout_setting,
    endpoints_dir_setting,
    exit_timeout_setting,
    heartbeat_interval_setting,
    interface_setting,
    local_rank_setting,
    master_port_setting,
    metrics_host,
    metrics_host_setting,
    metrics_port_setting,
    metrics_report_host,
    node_worker_metrics_port,
    progress_settings,
    rank_identity,
    rank_metrics_port,
    registration_settings,
    required_master_port,
    socket_environment,
    socket_name_setting,
    torchrun_place_setting,
)

__all__ = [
    "ALL_INTERFACES",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "LaunchEnv",
    "ProgressSettings",
    "RankIdentity",
    "RegistrationSettings",
    "SlurmTask",
    "agent_pid_setting",
    "backend_setting",
    "check_backend",
    "check_metrics_settings",
    "client_tls_setting",
    "collective_timeout_setting",
    "detect_launcher",
    "endpoints_dir_setting",
    "exit_timeout_setting",
    "heartbeat_interval_setting",
    "interface_setting",
    "local_rank_setting",
    "master_environment",
    "master_port_setting",
    "member_environment",
    "metrics_host",
    "metrics_host_setting",
    "metrics_port_setting",
    "metrics_report_host",
    "node_worker_metrics_port",
    "parse_launch_env",
    "process_environ",
    "progress_settings",
    "rank_identity",
    "rank_metrics_port",
    "registration_settings",
    "required_master_port",
    "slurm_task",
    "socket_environment",
    "socket_name_setting",
    "torchrun_place_setting",
]
