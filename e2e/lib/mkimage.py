#!/usr/bin/env python3
"""Writes a container image as a docker-archive tarball (what `ctr images import`
reads), without a registry or a container engine.

    mkimage.py OUT.tar NAME:TAG --layer A.tar [--layer DIR ...] \
               [--entrypoint JSON] [--cmd JSON] [--env K=V ...] [--workdir /]

Each --layer is an uncompressed tar file or a directory (packed as a tar with
root ownership). Layers stack in the order given.
"""

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack_dir(src, dst):
    """A tar of the directory's contents, owned by root, in a stable order."""
    def owned_by_root(ti):
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = 0
        return ti

    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as t:
        for root, dirs, files in os.walk(src):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                t.add(full, arcname=os.path.relpath(full, src), recursive=False, filter=owned_by_root)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--layer", action="append", required=True)
    ap.add_argument("--entrypoint", default=None)
    ap.add_argument("--cmd", default=None)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--workdir", default="/")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="mkimage.")
    try:
        layers, diff_ids = [], []
        for i, src in enumerate(a.layer):
            tar = os.path.join(work, f"layer{i}.tar")
            if os.path.isdir(src):
                pack_dir(src, tar)
            else:
                shutil.copyfile(src, tar)
            digest = sha256_file(tar)
            os.makedirs(os.path.join(work, digest), exist_ok=True)
            os.rename(tar, os.path.join(work, digest, "layer.tar"))
            layers.append(f"{digest}/layer.tar")
            diff_ids.append(f"sha256:{digest}")
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env
        config = {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {"Env": env, "WorkingDir": a.workdir},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": f"mkimage.py layer {i}"}
                        for i in range(len(layers))],
        }
        if a.entrypoint:
            config["config"]["Entrypoint"] = json.loads(a.entrypoint)
        if a.cmd:
            config["config"]["Cmd"] = json.loads(a.cmd)
        blob = json.dumps(config, sort_keys=True).encode()
        config_name = hashlib.sha256(blob).hexdigest() + ".json"
        with open(os.path.join(work, config_name), "wb") as f:
            f.write(blob)
        with open(os.path.join(work, "manifest.json"), "w") as f:
            json.dump([{"Config": config_name, "RepoTags": [a.name], "Layers": layers}], f)
        with tarfile.open(a.out + ".tmp", "w") as t:
            for entry in sorted(os.listdir(work)):
                t.add(os.path.join(work, entry), arcname=entry)
        os.replace(a.out + ".tmp", a.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
