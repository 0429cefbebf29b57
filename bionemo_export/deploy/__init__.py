"""Deploy a generated model repository past one machine: Kubernetes manifests (KServe and plain)."""

from .kubernetes import (
    DeployError,
    DeploySettings,
    RepositoryFacts,
    StorageLocation,
    parse_storage_uri,
    read_repository,
    write_manifests,
)

__all__ = [
    "DeployError",
    "DeploySettings",
    "RepositoryFacts",
    "StorageLocation",
    "parse_storage_uri",
    "read_repository",
    "write_manifests",
]
