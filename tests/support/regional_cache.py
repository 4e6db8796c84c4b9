"""A regional read-through cache for tests and benchmarks: a second SeaweedFS mounting the origin.

`RegionalCache.start(data_dir, origin_endpoint)` starts a `weed mini` of its own (the "region")
and, in `weed shell`, configures the origin as remote storage and mounts the origin's test bucket
lazily (`remote.mount -metadataStrategy=lazy`, ../shared/NOTES.md "SeaweedFS as a regional
read-through cache"). The region's S3 gateway then serves the origin's objects under the bucket
name `MOUNT` (path-style, signed with the test credentials): the first read of an object is
fetched from the origin, later reads (and concurrent first reads) are served from the region.

Put a `CountingProxy` between them (`origin_endpoint=door.endpoint`) to count what the region
fetched from the origin. Only immutable keys belong there: an object overwritten at the origin
is not revalidated, and a lazy mount lists nothing.

    cache = RegionalCache.start(tmp / "region", door.endpoint)
    loader --mirror f"{cache.url('prefix')},credentials={cache.credentials_dir(tmp / 'creds')}"
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.seaweedfs import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFS

#: The bucket name the region serves the origin's bucket under (the mount's directory name).
MOUNT = "origin"
#: Without these the region refuses an origin on loopback or a private address, and its readers
#: only see 404 NoSuchKey (the reason is in the region's log alone).
UNTRUSTED_FLAGS = (
    "-filer.allowUntrustedRemoteEndpoints",
    "-s3.allowUntrustedRemoteEndpoints",
    "-volume.allowUntrustedRemoteEndpoints",
)


@dataclass
class RegionalCache:
    """A running regional SeaweedFS whose bucket `MOUNT` reads through to the origin's bucket."""

    server: SeaweedFS
    origin_endpoint: str

    @classmethod
    def start(
        cls, data_dir: Path, origin_endpoint: str, *, origin_bucket: str = BUCKET
    ) -> RegionalCache:
        """Start a region in `data_dir` that caches `origin_bucket` at `origin_endpoint` (the
        origin's S3 URL, or a proxy in front of it); fail loudly (with the shell's output) if
        the mount does not take."""
        server = SeaweedFS.start(data_dir, extra_args=UNTRUSTED_FLAGS)
        cache = cls(server, origin_endpoint)
        try:
            cache._mount(origin_bucket)
        except BaseException:
            server.stop()
            raise
        return cache

    @property
    def endpoint(self) -> str:
        """The region's S3 endpoint (readers sign for it with the test credentials)."""
        return self.server.endpoint

    def url(self, prefix: str = "") -> str:
        """The mirror's bucket URL for the origin's `s3://<BUCKET>/<prefix>` (same key layout)."""
        return f"s3://{MOUNT}/{prefix}".rstrip("/")

    def settings(self) -> dict[str, str]:
        """The S3 settings a reader of the region needs (a mirror's credentials Secret keys)."""
        return self.server.env

    def credentials_dir(self, directory: Path) -> Path:
        """Write `settings()` as one file per key into `directory` (a mounted Secret's layout)
        and return it: the `credentials=` / `credentialsDir` of a mirror."""
        return write_credentials(directory, self.settings())

    def mirror(self, prefix: str, directory: Path) -> dict[str, Any]:
        """One entry of HOTLOAD_MIRRORS for this region (credentials written to `directory`)."""
        return {"url": self.url(prefix), "credentialsDir": str(self.credentials_dir(directory))}

    def stop(self) -> None:
        """Stop the region's server."""
        self.server.stop()

    def kill(self) -> None:
        """Kill the region's server at once (a cache lost mid-update)."""
        self.server.kill()

    def shell(self, commands: str, timeout: float = 60) -> str:
        """Run `weed shell` commands (one per line) against the region; return their output."""
        done = subprocess.run(
            [
                self.server.binary,
                "shell",
                f"-master=127.0.0.1:{self.server.ports['master']}",
                f"-filer=127.0.0.1:{self.server.ports['filer']}",
            ],
            input=commands.encode(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        return (done.stdout + done.stderr).decode(errors="replace")

    def _mount(self, origin_bucket: str) -> None:
        configure = (
            f"remote.configure -name=origin -type=s3 -s3.access_key={ACCESS_KEY} "
            f"-s3.secret_key={SECRET_KEY} -s3.endpoint={self.origin_endpoint} "
            "-s3.region=us-east-1 -s3.force_path_style=true\n"
        )
        mount = (
            f"remote.mount -dir=/buckets/{MOUNT} -remote=origin/{origin_bucket} "
            "-metadataStrategy=lazy\n"
        )
        deadline = time.monotonic() + 60
        output = ""
        while time.monotonic() < deadline:
            # The shell needs the master to have elected itself and the filer up: retry.
            output = self.shell(configure + mount)
            if self._mounted():
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the regional cache could not mount the origin bucket {origin_bucket!r} at "
            f"{self.origin_endpoint}; weed shell said:\n{output}\nregion log:\n"
            f"{self.server.log_tail()}"
        )

    def _mounted(self) -> bool:
        return f"/buckets/{MOUNT}" in self.shell("remote.mount\n", timeout=30)


def write_credentials(directory: Path, settings: dict[str, str]) -> Path:
    """Write `settings` as one file per key into `directory` (the layout of a mounted Secret)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in settings.items():
        (directory / name).write_text(value)
    return directory
