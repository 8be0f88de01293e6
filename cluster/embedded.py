"""Ray Train's ``TorchTrainer`` on an embedded local Ray, without the parts that serve nothing there.

An embedded Ray (:func:`cluster.launch.ensure_ray`) is one node of this machine, started by this command and shut
down with it: nothing can autoscale it, nobody reads its State API, and this trainer is given no Ray Datasets.
Ray Train still starts, for every run:

* the **autoscaling coordinator**, an actor (a process of its own, importing Ray Data) the controller creates and
  waits on before it places any worker, to tell a cluster autoscaler what the run needs (and again every 20 s);
  that wait (the actor's process start and imports) adds to every command's time to the first step;
* the **placement-group cleaner**, an actor polling the State API every second to free the run's placement group
  should the controller die (an embedded Ray is shut down with this process, its placement groups with it);
* the **Ray Datasets manager**.

Every idle Ray actor also wakes its main thread every 10 ms, a small but constant share of a core. On a cluster
(``cluster.address``) none of this applies and the stock ``TorchTrainer`` runs. This module imports Ray Train's
internals at the top: import it only to run through Ray (the controller process imports it to unpickle the
scaling policy, as it imports Ray Train's own).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy


class LocalScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy (the worker group has ``num_workers`` workers, restarted on failure) without
    its resource requests to the autoscaling coordinator: an embedded Ray has no autoscaler to tell, so the
    coordinator actor is never created."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass


class EmbeddedTorchTrainer(TorchTrainer):
    """``TorchTrainer`` with :class:`LocalScalingPolicy` and without the placement-group cleaner and the Ray
    Datasets manager (see the module's docstring)."""

    def _create_default_callbacks(self):
        unused = (PlacementGroupCleanerCallback, DatasetsCallback)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        policy = controller_init_kwargs.get("scaling_policy")
        if type(policy) is FixedScalingPolicy:  # an elastic run (a range of workers) keeps Ray's own
            controller_init_kwargs["scaling_policy"] = LocalScalingPolicy(policy.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
