"""Ray only where Ray is used.

A job that trains in this process (``cluster.use_ray=false``, one worker with nothing for Ray to do, or a rank of a
``torchrun`` launch) and every command that neither starts nor reaches Ray (resume and train in one process,
export, eval, verify, runs, grow, prune, anneal, the MLflow UI) never imports Ray, so they work where it is not
installed: an offline GPU node set up from a wheelhouse built ``--without ray``, a container that lacks it. What
needs Ray (a job of several workers through Ray Train, a cluster address, the ``cluster``/``submit``/``jobs``
commands) checks for it first and says so in one line (exit 2) instead of failing on an import.
"""

from __future__ import annotations

import importlib.util

from pretrain.config import ClusterConfig, ConfigError

_INSTALL = (
    "install Ray (requirements.txt pins it; ./launch.sh setup installs it; a setup --offline from a wheelhouse made "
    "--without ray needs a wheelhouse made with it)"
)


class RayMissingError(ConfigError):
    """What was asked runs on Ray, and Ray is not installed in this Python environment."""


def ray_installed() -> bool:
    """Whether ``import ray`` would find Ray (without importing it)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def require_ray(what: str, instead: str = "") -> None:
    """Raise :class:`RayMissingError` (one line: ``what`` needs Ray; ``instead``, then how to install it) when
    Ray is not installed."""
    if not ray_installed():
        raise RayMissingError(f"{what} runs on Ray, which is not installed in this environment: {instead}{_INSTALL}")


def require_ray_for(cluster: ClusterConfig) -> None:
    """Refuse, before anything starts, a job that would train through Ray where Ray is not installed."""
    if cluster.trains_in_process():
        return
    require_ray(
        f"cluster.use_ray: this job ({cluster.num_workers} worker(s) through Ray Train)",
        "set cluster.use_ray=false to train in this process (or under torchrun: docs/configuration.md), or ",
    )
