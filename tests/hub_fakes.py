"""A fake Hugging Face Hub for the loader's Hub tests (no network): huggingface_hub's snapshot_download and
list_repo_files over tiny local repos, recording what they were asked."""
from __future__ import annotations

import fnmatch
import os
import shutil


class FakeHub:
    """snapshot_download over {repo_id: local model dir}: "downloads" copy the allowed files into a cache, cached
    snapshots are served with local_files_only=True; every call is recorded (listings apart, in `listings`).
    offline: every call that needs the network raises huggingface_hub's OfflineModeIsEnabled, as HF_HUB_OFFLINE=1
    makes it do."""

    def __init__(self, cache, repos, error=None):
        self.cache, self.repos, self.error, self.calls, self.listings = cache, repos, error, [], []
        self.offline = False

    def install(self, monkeypatch) -> "FakeHub":
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub, "snapshot_download", self)
        monkeypatch.setattr(huggingface_hub, "list_repo_files", self.list_repo_files)
        return self

    def _online(self):
        from huggingface_hub.errors import OfflineModeIsEnabled

        if self.offline:
            raise OfflineModeIsEnabled("offline mode is enabled")
        if self.error is not None:
            raise self.error

    def list_repo_files(self, repo_id, *, revision=None, repo_type=None, token=None):
        self.listings.append(dict(repo_id=repo_id, revision=revision, token=token))
        self._online()
        src = self.repos[repo_id]
        return sorted(os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
                      for d, _, files in os.walk(src) for f in files)

    def __call__(self, repo_id, *, revision=None, cache_dir=None, token=None, allow_patterns=None,
                 local_files_only=False, ignore_patterns=None):
        from huggingface_hub.errors import LocalEntryNotFoundError

        self.calls.append(dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, token=token,
                               allow_patterns=list(allow_patterns), local_files_only=local_files_only,
                               ignore_patterns=list(ignore_patterns or [])))
        snap = os.path.join(cache_dir or self.cache, repo_id.replace("/", "--"), revision or "main")
        if local_files_only:
            if os.path.isdir(snap):
                return snap
            raise LocalEntryNotFoundError("not in the cache")
        self._online()
        os.makedirs(snap, exist_ok=True)
        src = self.repos[repo_id]
        for folder, _, files in os.walk(src):
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), src)  # the Hub's patterns match the repo path
                if any(fnmatch.fnmatch(rel, p) for p in allow_patterns) and \
                        not any(fnmatch.fnmatch(rel, p) for p in ignore_patterns or []):
                    os.makedirs(os.path.dirname(os.path.join(snap, rel)), exist_ok=True)
                    shutil.copy(os.path.join(src, rel), os.path.join(snap, rel))
        return snap
