"""The GPU figures RESULTS.md quotes until a GPU run replaces them (issue #12).

Sources are the research note /work/shared/research/anchors-2026-11.md
(section 2, "Headline numbers") and the repositories it cites.
"""

_ROWS = [
    ("NVLink, UCX `cuda_ipc`, H100, same node", "~100+ GB/s per direction",
     "TensorRT-LLM PR #17241: ~100 GB/s `cuda_ipc` on H100, 0.4 ms per transfer, against "
     "~427 MB/s (192.8 ms) when UCX silently fell back to `sysv`"),
    ("RDMA, 400 Gb/s NIC, nixlbench UCX", "~85 % of line rate (42.6 GB/s)",
     "ai-dynamo/nixl PR #1647 (MI355X + AINIC RoCE, 16 MB blocks)"),
    ("EFA, Mooncake Transfer Engine, GPU→GPU write", "97.5 % of line rate (780 GB/s of "
     "16×400 Gb/s)", "Mooncake docs/source/design/transfer-engine/efa_transport.md (p6-b300)"),
    ("small op, nixlbench", "4 KiB WRITE: 4.2 µs average (post 1.2 µs)",
     "ai-dynamo/nixl PR #2024"),
]

SECTION = "\n".join([
    "## GPU figures, on paper until measured",
    "",
    "No GPU was available for these runs. What the transport reaches on GPUs according to",
    "public sources; the sidecar's job there is to add nothing per byte:",
    "",
    "| path | expected | source |",
    "| --- | --- | --- |",
    *(f"| {a} | {b} | {c} |" for a, b, c in _ROWS),
    "",
    "What the sidecar adds per request does not scale with bytes: the engine's IPC",
    "round trip, planning, the lease claim on P over the peer channel, posting and",
    "completion polling. On this CPU machine that is the gap between the 1-block",
    "latency and its raw NIXL baseline, and the daemon CPU per read of the sustained",
    "figure (both in the table above). On GPUs `transfer()` returns at once (PROC)",
    "and the copy runs on the wire while the worker polls, so for bulk transfers the",
    "per-request cost is amortised over the bytes; descriptor count matters more on",
    "RDMA than on NVLink (each scattered descriptor is a work request; vLLM #55434",
    "measured descriptor posting at 56.9 % of transfer time on MNNVL `cuda_ipc`).",
])
