"""What the server saw during a run: deltas of Triton's model statistics (the batches it formed,
queue time), its metrics port (queue time, GPU), and memory sampled while the load runs (RSS of
the python-backend stub processes of the server under test, when it runs on this machine)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

NS_PER_MS = 1_000_000
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _get(url: str, timeout: float = 5.0) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    with opener.open(url, timeout=timeout) as response:
        return response.read().decode()


# ---- Triton's statistics extension ------------------------------------------------------------


def model_stats(http_url: str, model: str) -> dict:
    """GET /v2/models/<model>/stats: the statistics of the model's (first) version."""
    return json.loads(_get(f"{http_url}/v2/models/{model}/stats"))["model_stats"][0]


@dataclass(frozen=True)
class Batching:
    """The batches Triton formed between two statistics snapshots."""

    executions: int  # execute() calls
    inferences: int  # requests they held
    batch_sizes: Mapping[int, int]  # requests per execute() -> how many execute() calls
    queue_ms: float | None  # mean time a request waited in Triton's queue
    compute_ms: float | None  # mean time of one execute() (compute_infer)

    @property
    def mean_batch_size(self) -> float | None:
        """Requests per execute(), on average: batching efficiency."""
        return self.inferences / self.executions if self.executions else None


def batching_delta(before: Mapping, after: Mapping) -> Batching:
    """Batching between two model_stats() snapshots."""
    sizes_before = {b["batch_size"]: _count(b["compute_infer"]) for b in before["batch_stats"]}
    sizes = {}
    for entry in after["batch_stats"]:
        n = _count(entry["compute_infer"]) - sizes_before.get(entry["batch_size"], 0)
        if n:
            sizes[entry["batch_size"]] = n
    queue = _delta(before, after, "queue")
    executions = int(after["execution_count"]) - int(before["execution_count"])
    compute_ns = sum(int(b["compute_infer"]["ns"]) for b in after["batch_stats"]) - sum(
        int(b["compute_infer"]["ns"]) for b in before["batch_stats"]
    )
    return Batching(
        executions=executions,
        inferences=int(after["inference_count"]) - int(before["inference_count"]),
        batch_sizes=dict(sorted(sizes.items())),
        queue_ms=queue[1] / queue[0] / NS_PER_MS if queue[0] else None,
        compute_ms=compute_ns / executions / NS_PER_MS if executions else None,
    )


def _count(stat: Mapping) -> int:
    return int(stat.get("count", 0))


def _delta(before: Mapping, after: Mapping, name: str) -> tuple[int, int]:
    """(count, ns) of one inference_stats entry between two snapshots."""
    a, b = before["inference_stats"][name], after["inference_stats"][name]
    return _count(b) - _count(a), int(b.get("ns", 0)) - int(a.get("ns", 0))


# ---- the metrics port -------------------------------------------------------------------------


def scrape(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse a Prometheus text page into (name, labels, value) samples."""
    samples = []
    for line in _get(metrics_url).splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric_sum(samples, name: str, **labels: str) -> float | None:
    """The sum of a metric's samples whose labels include `labels`; None if there is none."""
    values = [
        value
        for sample_name, sample_labels, value in samples
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def metrics_queue_ms(before, after, model: str) -> float | None:
    """Mean queue time per request from nv_inference_queue_duration_us / nv_inference_count."""
    queue = [metric_sum(s, "nv_inference_queue_duration_us", model=model) for s in (before, after)]
    count = [metric_sum(s, "nv_inference_count", model=model) for s in (before, after)]
    if None in queue or None in count or count[1] == count[0]:
        return None
    return (queue[1] - queue[0]) / (count[1] - count[0]) / 1000


# ---- memory and accelerator, sampled during the run ------------------------------------------


def stub_pids(model: str, server_url: str, proc: Path = Path("/proc")) -> list[int]:
    """Python-backend stub processes of `model` started by the tritonserver that listens at
    `server_url` (its HTTP or gRPC address): children of that server only, so another server of
    the same model on this machine is not counted. Empty when that server is not local."""
    servers = listening_pids(_endpoint(server_url), proc)
    pattern = re.compile(rf"/{re.escape(model)}/\d+/model\.py$")
    pids = []
    for entry in _pid_dirs(proc):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not (argv and argv[0].endswith(b"triton_python_backend_stub")):
            continue
        if any(pattern.search(arg.decode(errors="replace")) for arg in argv[1:]):
            if _parent(entry) in servers:
                pids.append(int(entry.name))
    return sorted(pids)


def _endpoint(url: str) -> tuple[str, int]:
    """(IP address, port) of an http://host:port URL or a host:port gRPC address."""
    parsed = urllib.parse.urlsplit(url if "//" in url else f"//{url}")
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"not an address with a port: {url!r}")
    return socket.gethostbyname(parsed.hostname), parsed.port


def listening_pids(endpoint: tuple[str, int], proc: Path = Path("/proc")) -> set[int]:
    """Processes holding a TCP socket that listens at `endpoint` (IP, port): on that address or
    on every address. Only processes whose open files we may read are seen."""
    ip, port = endpoint
    wanted = {
        inode
        for address, listen_port, inode in listening_sockets(proc)
        if listen_port == port and address in (ip, "0.0.0.0", "::")
    }
    links = {f"socket:[{inode}]" for inode in wanted}
    found = set()
    for entry in _pid_dirs(proc) if links else ():
        if links & _socket_links(entry):
            found.add(int(entry.name))
    return found


def _socket_links(entry: Path) -> set[str]:
    """The targets of a process's fd links; empty once it is gone or not ours to read. An fd
    closed while we look is skipped alone: a busy server opens and closes sockets all the time."""
    try:
        fds = list((entry / "fd").iterdir())
    except OSError:
        return set()
    targets = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            targets.add(os.readlink(fd))
    return targets


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def listening_sockets(proc: Path = Path("/proc")) -> list[tuple[str, int, int]]:
    """(address, port, inode) of every listening TCP socket in /proc/net/tcp and tcp6."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                address, port = fields[1].split(":")
                found.append((_address(address), int(port, 16), int(fields[9])))
    return found


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp writes it (32-bit words in host byte order) -> text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(
        int.from_bytes(raw[i : i + 4], sys.byteorder).to_bytes(4, "big")
        for i in range(0, len(raw), 4)
    )
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:a.b.c.d: an IPv4 client of a v6 socket
    return str(mapped or ip)


def _pid_dirs(proc: Path) -> list[Path]:
    return [entry for entry in proc.iterdir() if entry.name.isdigit()]


def _parent(entry: Path) -> int | None:
    """The parent pid of a /proc/<pid> entry (None once it is gone)."""
    try:
        text = (entry / "stat").read_text()
    except OSError:
        return None
    return int(text[text.rfind(")") + 2 :].split()[1])  # the command name may hold ")"


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_memory_used() -> float | None:
    """Fraction of this machine's memory in use (MemTotal - MemAvailable) / MemTotal."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total = int(info["MemTotal"].split()[0])
        available = int(info["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return (total - available) / total


@dataclass
class Resources:
    """Peaks and means of what was sampled during the run."""

    stub_pids: list[int] = field(default_factory=list)
    stub_rss_bytes: int | None = None  # peak of the sum over the model's stubs (local only)
    host_memory_used: float | None = None  # peak fraction
    gpu_utilization: float | None = None  # mean fraction over the run (Triton's metrics)
    gpu_memory_used: float | None = None  # peak fraction (Triton's metrics)
    samples: int = 0


class ResourceSampler:
    """Samples memory and GPU figures every `interval_s` in a thread while the load runs."""

    def __init__(self, model: str, server_url: str, metrics_url: str, interval_s: float = 0.5):
        self.model, self.server_url = model, server_url
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.resources = Resources()
        self._utilization: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stress-sampler", daemon=True)

    def __enter__(self) -> ResourceSampler:
        self.resources.stub_pids = stub_pids(self.model, self.server_url)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # at least one sample, even for a very short run
        if self._utilization:
            self.resources.gpu_utilization = sum(self._utilization) / len(self._utilization)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        r = self.resources
        r.samples += 1
        if r.stub_pids:
            r.stub_rss_bytes = max(r.stub_rss_bytes or 0, sum(rss_bytes(p) for p in r.stub_pids))
        used = host_memory_used()
        if used is not None:
            r.host_memory_used = max(r.host_memory_used or 0.0, used)
        try:
            samples = scrape(self.metrics_url)
        except OSError:
            return
        utilization = metric_sum(samples, "nv_gpu_utilization")
        gpus = len([s for s in samples if s[0] == "nv_gpu_utilization"])
        if utilization is not None and gpus:
            self._utilization.append(utilization / gpus)
        used_bytes = metric_sum(samples, "nv_gpu_memory_used_bytes")
        total_bytes = metric_sum(samples, "nv_gpu_memory_total_bytes")
        if used_bytes is not None and total_bytes:
            r.gpu_memory_used = max(r.gpu_memory_used or 0.0, used_bytes / total_bytes)
