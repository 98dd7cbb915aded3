"""cluster: the Ray cluster, GPU placement and the shared folder of a multi-node run."""

from __future__ import annotations

from pydantic import Field

from rlflow.engines.core.config.base import Section


class ClusterConfig(Section):
    address: str | None = Field(
        None, description="Ray address to join ('auto' joins the one in RAY_ADDRESS); empty starts a private local Ray."
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray; empty: all.")
    cpus_per_worker: float = Field(0.5, ge=0, description="CPUs Ray reserves for each train/rollout actor.")
    object_store_mb: int = Field(512, gt=0, description="Object store size of a local Ray, MiB.")
    use_ray: bool = Field(True, description="False runs the workers inside the flow process (debugging).")
    colocate: bool = Field(
        False,
        description="GPU placement. true: rollout worker i shares train worker i's GPU; the rollout engine releases "
        "its weights' memory while training runs and takes the new ones after (slime's --colocate). false "
        "(disaggregated): train and rollout workers get GPUs of their own.",
    )
    shared_dir: str | None = Field(
        None, description="A folder every node mounts at the same path (NFS, Lustre, ...): the run's working files go "
        "there (the built model, checkpoints before they are committed to the store, a resumed checkpoint), since "
        "workers read and write them by path. Required when workers run on other nodes than the driver's (not "
        "when train.backend torch checkpoints into an object store and model.path is set); empty: the driver's "
        "temporary folder.")
    collective_timeout_s: float = Field(
        1800, gt=0, description="How long a torch.distributed collective (train ranks, weight-sync groups) waits for "
        "a peer before it fails the stage: a dead or hung rank ends the step, and the run resumes from its last "
        "checkpoint, instead of hanging.")
