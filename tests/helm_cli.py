"""The `helm` CLI for tests, built as CI builds it.

`hack/local-cluster/build.sh helm` (part of `build.sh all`) builds helm.sh/helm/v4's
cmd/helm at versions.env's HELM_VERSION from the Go module proxy; a second call is a stamp
check. Without Go the tests that need it are skipped with the reason, and fail under CI=true
(as tests/nvidia_toolkit.py does for the NVIDIA toolkit).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import gobuilt

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = ROOT / "hack" / "local-cluster"


def version() -> str:
    return gobuilt.pinned("HELM_VERSION")


def build() -> Path:
    """The helm binary; skips (fails under CI) where it cannot be built."""
    gobuilt.build("helm")
    return LOCAL_CLUSTER / "bin" / f"helm-{version()}" / "helm"


class HelmFailed(RuntimeError):
    """helm exited non-zero (or is not built); the message is helm's own error line."""


@dataclass(frozen=True)
class Helm:
    """One helm binary, run with a private HOME-like set of folders so that no user's
    repositories, plugins or registry logins change what it does."""
    binary: Path
    home: Path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        if not self.binary.exists():
            raise HelmFailed(f"{self.binary} is not built: run hack/local-cluster/build.sh helm")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            # client-go's discovery cache goes to $HOME/.kube/cache; without HOME it was
            # written relative to the working directory, into the checkout
            "HOME": str(self.home),
            # No cluster, whatever the caller's KUBECONFIG: renders use Helm's built-in
            # capabilities (as the Python engine does) and a dry run stays client-side.
            "KUBECONFIG": str(self.home / "no-kubeconfig"),
        }
        done = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=env, timeout=300)
        if check and done.returncode:
            raise HelmFailed(f"helm {' '.join(args)}: {done.stderr.strip()}")
        return done

    def values_file(self, values: dict) -> Path:
        # JSON is YAML; one file per distinct value set, so parallel renders do not collide.
        text = json.dumps(values, sort_keys=True)
        path = self.home / f"values-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        path.write_text(text)
        return path

    def template(self, chart: Path, values: dict | None = None, release: str = "dra",
                 namespace: str = "dra-system", *extra: str) -> subprocess.CompletedProcess:
        """`helm template` as a user runs it before `helm install` (install, not upgrade);
        extra: more flags, e.g. `--api-versions` for what a cluster's discovery would say."""
        return self.run("template", release, str(chart), "--namespace", namespace,
                        "-f", str(self.values_file(values or {})), *extra, check=False)

    def objects(self, chart: Path, values: dict | None = None, release: str = "dra",
                namespace: str = "dra-system", *extra: str) -> list[dict]:
        done = self.template(chart, values, release, namespace, *extra)
        if done.returncode:
            raise HelmFailed(f"helm template {release} with {json.dumps(values)}: {done.stderr.strip()}")
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    def notes(self, chart: Path, values: dict | None = None, release: str = "dra",
              namespace: str = "dra-system") -> str:
        """NOTES.txt as `helm install` prints it (`helm template` leaves it out): a client
        dry run, which contacts no cluster."""
        done = self.run("install", release, str(chart), "--namespace", namespace, "--dry-run=client",
                        "-o", "json", "-f", str(self.values_file(values or {})))
        return json.loads(done.stdout)["info"]["notes"]
