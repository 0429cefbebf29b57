"""Find or provide the Triton binaries (tritonserver, perf_analyzer) and run them."""

from .discovery import TritonInstall, TritonNotFoundError, find_tritonserver, prepare_embedded_tritonserver
from .perf_analyzer import PerfAnalyzer, PerfAnalyzerNotFoundError, find_perf_analyzer
from .server import Endpoints, TritonServer, TritonStartError, free_ports, probe_server

__all__ = [
    "Endpoints",
    "PerfAnalyzer",
    "PerfAnalyzerNotFoundError",
    "TritonInstall",
    "TritonNotFoundError",
    "TritonServer",
    "TritonStartError",
    "find_perf_analyzer",
    "find_tritonserver",
    "free_ports",
    "prepare_embedded_tritonserver",
    "probe_server",
]
