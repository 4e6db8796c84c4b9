"""The trainer-facing side: publishing snapshots to a bucket, its ledger and the fleet."""

from hotload.routes import RoutesError
from hotload.sdk.numerics import (
    Divergence,
    NumericsError,
    NumericsReport,
    ReplicaReport,
    numerics_check,
    numerics_check_async,
)
from hotload.sdk.outcomes import (
    NotReadyError,
    PublishError,
    PublishHandle,
    ReadyReport,
    ShardedPublishError,
    SnapshotRejectedError,
)
from hotload.sdk.publish import (
    Published,
    Uploaded,
    publish_folder,
    publish_folder_async,
    upload_hinted_async,
)
from hotload.sdk.publisher import Publisher
from hotload.sdk.replay import RolloutRoutes, replay_routes
from hotload.sdk.shard_plan import ShardPlan, plan_shards
from hotload.sdk.sharded import RankReport, ShardedPublisher

__all__ = [
    "Divergence",
    "NotReadyError",
    "NumericsError",
    "NumericsReport",
    "PublishError",
    "PublishHandle",
    "Published",
    "Publisher",
    "RankReport",
    "ReadyReport",
    "ReplicaReport",
    "RolloutRoutes",
    "RoutesError",
    "ShardPlan",
    "ShardedPublishError",
    "ShardedPublisher",
    "SnapshotRejectedError",
    "Uploaded",
    "numerics_check",
    "numerics_check_async",
    "plan_shards",
    "publish_folder",
    "publish_folder_async",
    "replay_routes",
    "upload_hinted_async",
]
