"""The `ray` transport (the default): each bucket of rank 0's weights goes to every rollout worker as one Ray
object, actor to actor through Ray's object store, never through the driver. It needs nothing but the core
protocols, so every backend takes it."""

from __future__ import annotations

from rlflow.engines.sync.base import WeightTransport


class RayObjectsTransport(WeightTransport):
    name = "ray"

    def push(self, version: int) -> None:
        for names in self.source.buckets():
            self.source.send_objects(self.rollout, names, version)
