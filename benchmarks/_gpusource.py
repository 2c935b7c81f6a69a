"""Which code a GPU call measures: the ``source`` line ``bench_gpu.py`` prints before any part.

On a lent GPU machine the project runs from wheels built on the CPU machine (``bench_gpu.sh`` installs
``.gpu/whl``; ``../shared/gpu/build_wheels.sh`` builds them from HEAD and writes the commit beside them,
``mineonline-src.commit``). A checkout changed since (a new commit, an uncommitted fix) would be measured
as its older self: rollout workers, the trainer and the plugins import the wheels. So the line names the
wheels' commit and the checkout's, compares every ``.py`` file of every installed ``mineonline*``
distribution with the checkout's copy, and says ``ok: false`` with the files that differ; the parent
then stops before spending a minute of the GPU. An editable install (this CPU machine) is the checkout.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
from pathlib import Path


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def installed_files() -> dict[str, dict[str, Path]]:
    """Per installed ``mineonline*`` distribution, its ``.py`` files (path inside it -> installed file);
    an editable install lists none (its code is the checkout)."""
    out: dict[str, dict[str, Path]] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not name.startswith("mineonline"):
            continue
        files = {str(f): Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".py")}
        out[name] = {rel: path for rel, path in files.items() if ".dist-info" not in rel and "__editable__" not in rel}
    return out


def differing_files(installed: dict[str, dict[str, Path]], root: Path) -> list[str]:
    """The files whose installed copy differs from the checkout's, or that only one side has."""
    roots = [
        root,
        *sorted(p for p in (root / "plugins").glob("*") if p.is_dir()),
        *sorted((root / "examples").glob("*")),
    ]
    differ: list[str] = []
    for files in installed.values():
        tops = {rel.split("/")[0] for rel in files}
        for top in sorted(tops):
            home = next((r for r in roots if (r / top).exists()), None)
            if home is None:
                differ.append(f"{top} (not in the checkout)")
                continue
            ours = {rel: home / rel for rel in files if rel.split("/")[0] == top}
            if (home / top).is_dir():
                checkout = {str(p.relative_to(home)) for p in (home / top).rglob("*.py")}
            else:
                checkout = {top}
            for rel in sorted(set(ours) | checkout):
                if rel not in files or rel not in checkout or _sha(files[rel]) != _sha(home / rel):
                    differ.append(str((home / rel).relative_to(root)))
    return differ


def source_check(
    *, installed: dict[str, dict[str, Path]], root: Path, wheels_commit: str | None, checkout_commit: str | None
) -> dict:
    differ = differing_files(installed, root)
    commits_differ = bool(wheels_commit and checkout_commit and wheels_commit != checkout_commit)
    ok = not differ and not commits_differ
    out = {
        "wheels_commit": wheels_commit,
        "checkout_commit": checkout_commit,
        "installed": sorted(name for name, files in installed.items() if files) or "editable (the checkout)",
        "ok": ok,
    }
    if not ok:
        out["error"] = (
            f"the wheels were built from {wheels_commit or 'an unknown commit'}, the checkout is at "
            f"{checkout_commit or 'an unknown commit (no .git)'}"
            + (f"; {len(differ)} files differ: {', '.join(differ[:20])}" if differ else "")
            + ". Rebuild the wheels from this checkout (../shared/gpu/build_wheels.sh) before a GPU call."
        )
    return out


def source_line(*, wheels: Path, root: Path, quick: bool) -> str:
    """The ``source`` JSON line for the wheels in ``wheels`` and the checkout at ``root``."""
    commit_file = wheels.parent / "mineonline-src.commit"
    wheels_commit = commit_file.read_text().strip() if commit_file.exists() else None
    git = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    checkout_commit = git.stdout.strip() or None
    figures = source_check(
        installed=installed_files(), root=root, wheels_commit=wheels_commit, checkout_commit=checkout_commit
    )
    return json.dumps({"bench": "gpu", "part": "source", "quick": quick, **figures})
