"""A rendered pod's filesystem and environment, laid out in a local folder, so the real service can
start from exactly what Kubernetes would give it.

Every volumeMount of the pod's container becomes a folder under `root` (`/x/y` -> `root/x/y`):
projected ConfigMaps are written as files, the model repository claim is linked read-only by its
subPath, emptyDirs and volumeClaimTemplates become empty folders. Settings that name a container
path (an absolute path, or a SQLite URL of one) are moved under `root` the same way. Everything
outside the writable mounts stands for the read-only root filesystem: after a run,
`written_outside_writable_mounts` lists whatever the process wrote there, which on a cluster would
have failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import deploy_checks as dc


@dataclass
class Pod:
    """One pod of a rendered workload, materialised under `root`."""

    workload: dict
    root: Path
    env: dict[str, str]
    writable: list[str] = field(default_factory=list)  # container paths the process may write
    _before: set[Path] = field(default_factory=set)

    def path(self, container_path: str) -> Path:
        """Where a container path lies under `root`."""
        return self.root / container_path.lstrip("/")

    def written_outside_writable_mounts(self) -> list[str]:
        """Files created since materialisation that are not in a writable mount (as container
        paths): writes that the read-only root filesystem would have refused."""
        created = _files(self.root) - self._before
        outside = []
        for file in sorted(created):
            container_path = "/" + file.relative_to(self.root).as_posix()
            if not any(
                container_path.startswith(mount.rstrip("/") + "/") for mount in self.writable
            ):
                outside.append(container_path)
        return outside


def _files(root: Path) -> set[Path]:
    found = set()
    for folder, _, names in os.walk(root):  # does not follow the repository's symlinks
        found |= {Path(folder) / name for name in names}
    return found


def materialise(workload: dict, objects: list[dict], root: Path, repository: Path) -> Pod:
    """Lays out `workload`'s container filesystem under `root`.

    Args:
        repository: local folder standing for the model repository claim's contents.

    Raises:
        AssertionError: a mount names a volume the pod does not declare, or a setting names a
            container path that no volume holds (it would be on the read-only root filesystem).
    """
    root.mkdir(parents=True, exist_ok=True)
    pod = Pod(workload, root, {})
    for mount_path, (mount, volume) in dc.mounts_by_path(workload).items():
        assert volume is not None, f"{dc.name_of(workload)}: {mount['name']} is not a volume"
        target = pod.path(mount_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if "persistentVolumeClaim" in volume:
            source = repository / mount.get("subPath", "")
            assert source.is_dir(), f"the model repository has no {mount.get('subPath')}"
            target.symlink_to(source, target_is_directory=True)
            continue
        target.mkdir(parents=True, exist_ok=True)
        if "projected" in volume:
            for source in volume["projected"]["sources"]:
                config_map = dc.by_name(objects, "ConfigMap", source["configMap"]["name"])
                for name, text in config_map.get("data", {}).items():
                    (target / name).write_text(text)
        elif not mount.get("readOnly") and (
            "emptyDir" in volume or "volumeClaimTemplate" in volume
        ):
            pod.writable.append(mount_path)
    for name, value in dc.settings_of(workload, objects).items():
        # the relay shares the prediction pods' ConfigMap and reads only its own settings of it
        ignored = dc.app_of(workload) == dc.RELAY and not _relay_reads(name)
        pod.env[name] = value if ignored else _reroot(pod, name, value)
    pod._before = _files(root)
    return pod


def _relay_reads(name: str) -> bool:
    """Whether `mlpair relay` reads the PREDICTION_* variable ``name``."""
    from mlpair.commands.serve import RELAY_SETTINGS

    return name.removeprefix("PREDICTION_").lower() in RELAY_SETTINGS


def _reroot(pod: Pod, name: str, value: str) -> str:
    path = dc.sqlite_path(value)
    if path is not None:
        prefix = value[: -len(path)]
    elif value.startswith("/"):
        prefix, path = "", value
    else:
        return value
    assert path.startswith("/"), f"{name}={value}: a relative path lands on the root filesystem"
    # Inside a volume, or a folder that holds volumes (the config and model folders, which the
    # service only reads): anything else exists only in the image.
    holds_mounts = any(
        mount.startswith(path.rstrip("/") + "/") for mount in dc.mounts_by_path(pod.workload)
    )
    assert holds_mounts or dc.mount_for(pod.workload, path) is not None, (
        f"{dc.name_of(pod.workload)}: {name}={value} is in no volume, only in the image"
    )
    return prefix + str(pod.path(path))
