"""Place local files into Hugging Face caches, laid out as the Hub's own clients write them, so tests can use Hub
ids offline.

- `place_in_hub_cache(src_dir, cache_dir, "org/name")`: huggingface_hub's cache layout (`models--org--name/`
  with `blobs/<sha256>`, `snapshots/<commit>/<file>` symlinks to the blobs, and `refs/<revision>` holding the
  commit hash), which `snapshot_download(..., local_files_only=True)` reads. Any directory (a tiny model, a
  converted checkpoint) can be placed under any id.
- `place_in_datasets_cache(data_file, cache_dir, "org/name")`: a prepared `datasets` cache entry for a Hub
  dataset id (`org___name/<config>/0.0.0/<hash>/`), which `datasets.load_dataset("org/name", split=...)` reads
  when offline. Built by `datasets`' own Json builder from a JSONL/JSON file (`{split: file}` for several splits).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def place_in_hub_cache(src_dir: str | os.PathLike, cache_dir: str | os.PathLike, repo_id: str, *,
                       revision: str = "main", repo_type: str = "model") -> Path:
    """Copy every file under `src_dir` into `cache_dir` as the snapshot of `repo_id` at `revision`; returns the
    snapshot directory. The commit hash is derived from the files, so the same content gives the same commit."""
    src = Path(src_dir)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    hashes = {p: _sha256(p) for p in files}
    commit = hashlib.sha1("".join(f"{p.relative_to(src)}\0{h}\n" for p, h in hashes.items()).encode()).hexdigest()
    repo = Path(cache_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path, digest in hashes.items():
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return snapshot


def place_in_datasets_cache(data_files: str | os.PathLike | dict, cache_dir: str | os.PathLike, repo_id: str, *,
                            config: str = "default") -> Path:
    """Prepare `data_files` (a JSON/JSONL file, the "train" split, or {split: file}) as the cached Hub dataset
    `repo_id` (configuration `config`) under `cache_dir` (HF_DATASETS_CACHE); returns the prepared directory."""
    from datasets.packaged_modules.json.json import Json

    files = data_files if isinstance(data_files, dict) else {"train": data_files}
    namespace, name = repo_id.split("/")
    digest = hashlib.sha256("".join(f"{s}\0{_sha256(Path(f))}" for s, f in sorted(files.items())).encode())
    staging = Path(cache_dir) / f".staging-{digest.hexdigest()[:16]}"
    builder = Json(cache_dir=str(staging), dataset_name=name, config_name=config, config_id=config,
                   hash=digest.hexdigest()[:16], data_files={s: str(f) for s, f in files.items()})
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # staging/<name as datasets spells it>/<config>/0.0.0/<hash>
    built = prepared.parents[2]
    target = Path(cache_dir) / f"{namespace}___{built.name}"
    shutil.rmtree(target, ignore_errors=True)
    built.rename(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target / prepared.relative_to(built)
