"""Collectives as NCCL runs them, against published nccl-tests figures on DGX-class A100 and H100 nodes.

For each published point — a collective, a message size from 1 MiB to 1 GiB, a number of 8-GPU
nodes — the bus bandwidth :func:`pipexplore.predict.collectives.nccl_cost` predicts (with the
algorithm and protocol NCCL would choose, or the one the source forced with ``NCCL_ALGO``) beside
the one published, and the error. Nothing here is measured: the figures are copied from the
sources below, exactly as published (in-place ``busbw`` where both are given; where a source gives
times, the bus bandwidth is computed from them as nccl-tests does).

The nodes: Azure's ND A100 v4 (eight A100 SXM4 80 GB on NVSwitch, eight 200 Gb/s HDR InfiniBand
NICs, one a GPU) and ND H100 v5 (eight H100 SXM5 on NVSwitch, eight 400 Gb/s NDR NICs, one a GPU)
have the GPUs, NVSwitches and NICs of a DGX A100 and a DGX H100; Together AI's H100 nodes are HGX
H100 (the same eight GPUs and NVSwitches; only single-node figures are used from them).

How the sources ran nccl-tests matters below 4 MiB: ``-g 8`` drives all eight GPUs from one process
and one thread, which launches eight kernels an iteration: an iteration then takes at least eight
kernel launches (the catalogue's ``kernel_overhead``, 4.5 µs each: 36 µs; the sources' own tables
show it, flat at 35–45 µs from 128 B to 1–4 MiB). One process a GPU (``mpirun -np``) has no such
floor. The prediction takes the larger of the two.

What was read from these figures (so those points are not independent checks, and are marked ``*``):
the A100's NVLink bus bandwidth and the share a reduction keeps (1-node all-gather and all-reduce at
1 GiB, mscclpp), what one GPU a node gets of its NIC (the 2-node all-reduce of one A100 a node), and
each kind's ``ramp`` (the single-node all-reduce curves: Azure's for the A100, Together's ring
all-reduce for the H100's ring, Azure's NVLS all-reduce for NVLS). The H100's bandwidths are NCCL's
maintainers' statements (370 GB/s ring, 480 GB/s NVLS; 48–49 GB/s an NDR NIC), the A100's NIC is
theirs (24 GB/s of 25 for HDR; 192 GB/s across DGX A100 nodes), the latencies NCCL's own
(``src/graph/tuning.cc``). Every other point is a check.

Across nodes: beside the 2-node A100 figures at 1 GiB, H100 all-reduce curves (1 MiB–8 GiB) on 2, 4
and 8 HGX H100 nodes with eight 400 Gb/s NDR NICs each, as NCCL chooses (NVIDIA/nccl-tests#309: two
clusters, bare metal and VMs), and all-reduce, all-gather and all-to-all curves (32 MiB–8 GiB) on 2–32 AWS
p5.48xlarge (eight H100s, 32 EFA interfaces of 100 Gb/s: 400 Gb/s a GPU, as a DGX H100's; the
catalogue's ``H100-p5``: the DGX H100's fabric, with the 75 µs network latency aws-ofi-nccl reports to
NCCL on p5s added to each step across nodes as NCCL's tuner adds it, and the NDR NIC's efficiency, as
no EFA efficiency is published), where aws-ofi-nccl's tuner plugin, not NCCL's own tuner, chose the
all-reduce's algorithm. Every one of them is a check; none was read into a default. Not
found published (left out, not invented): per-size tables on 4 or more DGX-class A100 nodes (eight
HDR NICs a node), and H100 reduce-scatter curves across nodes.

Run: ``python benchmarks/nccl_tests.py`` (no GPU; a fraction of a second).
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

MiB = 2 ** 20


@dataclass(frozen=True)
class Published:
    """One published nccl-tests table: where it is from, what ran, and its points (bytes → busbw in
    GB/s, or → µs where ``times``)."""

    source: str
    device: str  # catalogue kind
    nodes: int
    gpus_per_node: int
    collective: str
    points: dict[int, float]
    gpus_per_process: int = 1  # 8: nccl-tests -g 8, one process driving the node
    algorithm: str | None = None  # forced with NCCL_ALGO; None: NCCL's choice
    times: bool = False  # points are µs, not GB/s
    calibration: frozenset[int] = field(default_factory=frozenset)  # points a default was read from


SIZES = [MiB * 2 ** k for k in range(11)]  # 1 MiB … 1 GiB

#: The sources, cited in full (benchmarks/README.md repeats them).
SOURCES = {
    "azure-a100": "Azure, AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md, 'NCCL Bandwidth' "
                  "(all_reduce_perf -b 8 -e 8G -f 2 -g 8, in-place busbw; NCCL 2.18.5), commit 3bb66ca, "
                  "2024-09-25. https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/"
                  "ND_A100_v4_results.md (its label 'NVLS algorithm' cannot hold on A100s, which have no NVLS: "
                  "taken as NCCL's choice)",
    "azure-h100": "Azure, AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md, 'NCCL Bandwidth' "
                  "(NCCL_ALGO=NVLS all_reduce_perf -b 8 -e 8G -f 2 -g 8, in-place busbw; NCCL 2.18.5), commit "
                  "ae0b6a7, 2024-09-24. https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/"
                  "ND_H100_v5_results.md",
    "msccl-h100": "Microsoft, msccl, docs/performance-nd-h100-v5.md, 'ND H100 v5 Performance', NCCL column "
                  "(fp16, 8 ranks by mpirun, -g 1, NCCL_MIN_NCHANNELS=32, in-place times; NCCL 2.18.3), commit "
                  "050b4a1, 2024-02-19. https://github.com/Azure/msccl/blob/main/docs/performance-nd-h100-v5.md",
    "together-h100": "Together AI, together-nccl-tests, benchmarks/H100/results/20260305_220043/"
                     "{all_reduce,all_gather,reduce_scatter}_ring.out (NCCL_ALGO=RING, -g 8, in-place busbw; "
                     "nccl-tests 2.17.9, NCCL 2.26.2), run 2026-03-05 (the results directory), commit 6698e53. "
                     "https://github.com/togethercomputer/together-nccl-tests/tree/main/benchmarks/H100/results",
    "hgx-h100-a": "NVIDIA/nccl-tests#309 'Acceptable performance of nccl-test on 2 or 4 HGX hosts?', its "
                  "description and 2025-05-23 comment (qoofyk): Dell XE9680 HGX, eight H100 SXM5 and eight "
                  "ConnectX-7 400 Gb/s InfiniBand a node; NCCL 2.26.2, all_reduce_perf -b 8 -e 16g -f 2 -g 1 by "
                  "mpirun, NCCL's choice, in-place busbw; 2 nodes bare metal, 4 nodes VMs (NCCL_TOPO_FILE). "
                  "https://github.com/NVIDIA/nccl-tests/issues/309",
    "hgx-h100-b": "NVIDIA/nccl-tests#309, 2025-06-18 comments (gj-aion): an 8-node H100 cluster on 400 Gb/s "
                  "InfiniBand (eight NICs a node: '~400 GB/s IB limit'), all_reduce_perf -b 1M -e 8G -f 2 -g 1 "
                  "by mpirun, default settings (the runs with NCCL_MIN_CTAS=24 left out), in-place busbw; "
                  "2, 4 and 8 nodes. https://github.com/NVIDIA/nccl-tests/issues/309",
    "p5-efa": "crazyguitar, aws-gpu-communication-benchmark, data/nccl_all_reduce.csv, nccl_all_gather.csv and "
              "nccl_alltoall.csv (in busbw), commit a77f70d, 2025-10-14: SageMaker HyperPod ml.p5.48xlarge (eight "
              "H100 SXM5, 32 EFA of 100 Gb/s), NCCL 2.27.7, aws-ofi-nccl 1.16.3 with "
              "NCCL_TUNER_PLUGIN=libnccl-ofi-tuner, -g 1, -n 1000 (k8s/nccl_all_reduce_perf.yaml, "
              "nccl_alltoall_perf.yaml); sizes in MiB. "
              "https://github.com/crazyguitar/aws-gpu-communication-benchmark/tree/main/data",
    "mscclpp-a100": "Microsoft, mscclpp, docs/performance-ndmv4.md, 'NDmv4 Performance', NCCL columns (8 ranks a "
                    "node by mpirun, -g 1, in-place busbw; NCCL 2.17.1), commit 85e664c, 2023-06-05. "
                    "https://github.com/microsoft/mscclpp/blob/85e664c/docs/performance-ndmv4.md",
}

_A100_AR = [36.22, 53.54, 71.43, 89.99, 109.22, 132.77, 166.63, 174.18, 213.87, 221.58, 228.10]
_H100_AR_NVLS = [43.70, 81.93, 128.73, 172.13, 234.45, 295.53, 361.78, 400.61, 423.38, 438.46, 466.35]
_H100_AR_US = [31.94, 37.95, 49.28, 77.01, 116, 187.2, 317.4, 572.5, 1079, 2071.1, 4028.7]
_H100_AG_US = [18.33, 23.18, 33.66, 44.7, 67.19, 104.7, 192.4, 368.3, 699.5, 1358.6, 2663.8]
_H100_AR_RING = [39.51, 85.44, 129.53, 184.95, 238.22, 274.53, 319.05, 336.55, 347.74, 355.88, 360.48]
_H100_AG_RING = [22.12, 44.14, 88.35, 159.00, 214.29, 239.60, 281.35, 302.39, 323.86, 338.43, 347.57]
_H100_RS_RING = [22.55, 43.09, 85.98, 145.98, 203.85, 247.78, 285.85, 309.12, 327.55, 337.74, 346.93]
_ALL = frozenset(SIZES)
GiB = 2 ** 30
_TO_8G = [MiB * 2 ** k for k in range(14)]  # 1 MiB … 8 GiB
# NVIDIA/nccl-tests#309, all-reduce in-place busbw (GB/s), 1 MiB … 8 GiB
_HGX_A = {2: [27.51, 51.32, 83.47, 119.72, 171.16, 235.02, 269.83, 335.88, 394.44, 427.43, 450.37, 461.91, 465.91,
              468.67],
          4: [24.71, 30.74, 52.77, 80.30, 125.85, 175.54, 226.37, 256.69, 293.45, 334.28, 358.51, 361.77, 363.79,
              365.19]}
_HGX_B = {2: [23.69, 42.05, 70.25, 104.51, 155.19, 233.28, 267.93, 334.99, 390.04, 424.50, 447.04, 458.73, 464.39,
              466.65],
          4: [21.78, 25.98, 46.64, 63.31, 113.55, 142.71, 211.26, 249.18, 235.91, 287.54, 318.48, 324.04, 325.86,
              324.11],
          8: [17.84, 28.82, 40.52, 51.38, 88.42, 129.98, 186.30, 229.88, 260.58, 301.18, 285.11, 317.87, 321.03,
              320.57]}
# crazyguitar/aws-gpu-communication-benchmark, p5.48xlarge, in-place busbw (GB/s): all-reduce 32 MiB … 8 GiB,
# all-gather 32 MiB … 2 GiB
_P5_SIZES = [MiB * 2 ** k for k in range(5, 14)]
_P5_AR = {2: [147.22, 225.95, 300.29, 365.84, 396.78, 436.04, 444.64, 465.55, 477.68],
          4: [100.19, 152.63, 229.85, 274.12, 278.68, 280.27, 347.56, 354.24, 357.08],
          8: [89.62, 102.49, 154.33, 234.18, 271.56, 273.66, 279.59, 351.73, 353.65],
          16: [77.75, 96.10, 128.73, 148.34, 230.42, 267.99, 274.40, 311.65, 353.92],
          32: [65.95, 82.86, 117.54, 139.49, 160.91, 220.88, 270.66, 299.83, 321.45]}
_P5_AG = {2: [136.42, 204.07, 237.77, 214.14, 276.79, 325.83, 334.26],
          4: [84.73, 144.09, 209.10, 254.99, 219.54, 288.79, 331.09],
          8: [45.82, 87.00, 144.42, 213.96, 262.83, 226.18, 295.21],
          16: [25.49, 46.62, 87.28, 146.73, 221.40, 261.42, 264.48],
          32: [12.73, 24.54, 45.88, 87.96, 148.06, 225.44, 263.66]}
# the same, all-to-all 32 MiB … 2 GiB (experts' token exchange; NCCL's grouped send/receive)
_P5_A2A = {2: [47.49, 62.08, 69.41, 74.05, 75.79, 77.80, 79.31],
           4: [39.06, 43.03, 52.20, 54.13, 53.64, 53.61, 54.00],
           8: [31.81, 35.06, 36.23, 44.70, 46.25, 48.44, 50.01],
           16: [25.83, 26.25, 31.73, 34.72, 40.18, 42.49, 44.22],
           32: [20.25, 24.96, 26.37, 30.39, 32.84, 38.68, 41.06]}

PUBLISHED = [
    Published("azure-a100", "A100-80GB", 1, 8, "all_reduce", dict(zip(SIZES, _A100_AR)), gpus_per_process=8,
              calibration=_ALL),
    Published("mscclpp-a100", "A100-80GB", 1, 8, "all_reduce", {GiB: 231.45}, calibration=frozenset({GiB})),
    Published("mscclpp-a100", "A100-80GB", 1, 8, "all_gather", {GiB: 253.59}, calibration=frozenset({GiB})),
    Published("mscclpp-a100", "A100-80GB", 1, 8, "all_to_all", {GiB: 254.69}),
    Published("mscclpp-a100", "A100-80GB", 2, 8, "all_reduce", {GiB: 183.82}),
    Published("mscclpp-a100", "A100-80GB", 2, 8, "all_gather", {GiB: 177.05}),
    Published("mscclpp-a100", "A100-80GB", 2, 8, "all_to_all", {GiB: 37.80}),
    Published("mscclpp-a100", "A100-80GB", 2, 1, "all_reduce", {GiB: 18.65}, calibration=frozenset({GiB})),
    Published("mscclpp-a100", "A100-80GB", 2, 1, "all_gather", {GiB: 15.84}),
    Published("mscclpp-a100", "A100-80GB", 2, 1, "all_to_all", {GiB: 15.48}),
    Published("azure-h100", "H100", 1, 8, "all_reduce", dict(zip(SIZES, _H100_AR_NVLS)), gpus_per_process=8,
              algorithm="nvls", calibration=_ALL),
    Published("together-h100", "H100", 1, 8, "all_reduce", dict(zip(SIZES, _H100_AR_RING)), gpus_per_process=8,
              algorithm="ring", calibration=_ALL),
    Published("together-h100", "H100", 1, 8, "all_gather", dict(zip(SIZES, _H100_AG_RING)), gpus_per_process=8,
              algorithm="ring"),
    Published("together-h100", "H100", 1, 8, "reduce_scatter", dict(zip(SIZES, _H100_RS_RING)), gpus_per_process=8,
              algorithm="ring"),
    Published("msccl-h100", "H100", 1, 8, "all_reduce", dict(zip(SIZES, _H100_AR_US)), times=True),
    Published("msccl-h100", "H100", 1, 8, "all_gather", dict(zip(SIZES, _H100_AG_US)), times=True),
    *(Published("hgx-h100-a", "H100", n, 8, "all_reduce", dict(zip(_TO_8G, v))) for n, v in _HGX_A.items()),
    *(Published("hgx-h100-b", "H100", n, 8, "all_reduce", dict(zip(_TO_8G, v))) for n, v in _HGX_B.items()),
    *(Published("p5-efa", "H100-p5", n, 8, "all_reduce", dict(zip(_P5_SIZES, v))) for n, v in _P5_AR.items()),
    *(Published("p5-efa", "H100-p5", n, 8, "all_gather", dict(zip(_P5_SIZES, v))) for n, v in _P5_AG.items()),
    *(Published("p5-efa", "H100-p5", n, 8, "all_to_all", dict(zip(_P5_SIZES, v))) for n, v in _P5_A2A.items()),
]


def predict(table: Published, nbytes: int) -> tuple[float, str]:
    """The predicted bus bandwidth (GB/s) of one published point, and the algorithm/protocol chosen."""
    from pipexplore.devices import device_spec
    from pipexplore.predict.collectives import bus_bandwidth, fabric_of, nccl_cost

    ranks = table.nodes * table.gpus_per_node
    cost = nccl_cost(table.collective, nbytes, ranks=ranks, nodes=table.nodes, fabric=fabric_of(table.device),
                     algorithm=table.algorithm)
    floor = table.gpus_per_process * device_spec(table.device).kernel_overhead  # -g 8: eight launches an iteration
    seconds = max(cost.seconds, floor)
    return bus_bandwidth(table.collective, nbytes, seconds, ranks) / 1e9, f"{cost.algorithm}/{cost.protocol}"


def published_busbw(table: Published, nbytes: int) -> float:
    from pipexplore.predict.collectives import bus_bandwidth

    value = table.points[nbytes]
    ranks = table.nodes * table.gpus_per_node
    return bus_bandwidth(table.collective, nbytes, value * 1e-6, ranks) / 1e9 if table.times else value


def rows() -> list[dict]:
    """Every published point with its prediction and error."""
    out = []
    for table in PUBLISHED:
        for nbytes in sorted(table.points):
            published = published_busbw(table, nbytes)
            predicted, chosen = predict(table, nbytes)
            out.append({"device": table.device, "nodes": table.nodes, "gpus": table.gpus_per_node,
                        "collective": table.collective, "bytes": nbytes, "published": published,
                        "predicted": predicted, "error": predicted / published - 1, "chosen": chosen,
                        "forced": table.algorithm or "", "source": table.source,
                        "calibration": nbytes in table.calibration})
    return out


def summary(out: list[dict], key) -> dict[str, dict]:
    """Median and max |error|, the count within 15 % and the median signed error of the rows grouped by ``key``."""
    groups: dict[str, list[float]] = {}
    for r in out:
        groups.setdefault(key(r), []).append(r["error"])
    return {name: {"n": len(e), "median": statistics.median(map(abs, e)), "max": max(map(abs, e)),
                   "within": sum(abs(x) <= 0.15 for x in e), "signed": statistics.median(e)}
            for name, e in groups.items()}


def _size(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def main() -> int:
    out = rows()
    print(f"{'device':>9} {'nodes':>5} {'collective':>14} {'size':>8} {'published':>9} {'predicted':>9} "
          f"{'error':>7}  {'chosen':<14} source")
    for r in out:
        mark = "*" if r["calibration"] else " "
        forced = f" (NCCL_ALGO={r['forced']})" if r["forced"] else ""
        print(f"{r['device']:>9} {r['nodes']:>3}x{r['gpus']:<1} {r['collective']:>14} {_size(r['bytes']):>8} "
              f"{r['published']:>9.1f} {r['predicted']:>9.1f} {r['error']:>+7.1%}{mark} {r['chosen']:<14} "
              f"{r['source']}{forced}")
    print("* a default was read from this point (not an independent check)")
    print()
    print(f"{'device':>9} {'nodes':>5} {'points':>6} {'median |error|':>14} {'max |error|':>11} "
          f"{'within 15 %':>11}   (checks only: {'median':>6} {'max':>6} {'n':>3})")
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for r in out:
        groups.setdefault((r["device"], r["nodes"], r["gpus"]), []).append(r)
    for (device, nodes, gpus), members in groups.items():
        errors = [abs(r["error"]) for r in members]
        checks = [abs(r["error"]) for r in members if not r["calibration"]]
        check_text = (f"{statistics.median(checks):>6.1%} {max(checks):>6.1%} {len(checks):>3}" if checks
                      else f"{'–':>6} {'–':>6} {0:>3}")
        print(f"{device:>9} {nodes:>3}x{gpus:<1} {len(members):>6} {statistics.median(errors):>14.1%} "
              f"{max(errors):>11.1%} {sum(e <= 0.15 for e in errors):>7}/{len(errors):<3}   "
              f"(checks only: {check_text})")
    print()
    print(f"{'by':>9} {'':>16} {'points':>6} {'median |error|':>14} {'max |error|':>11} {'within 15 %':>11}  signed median")
    for label, key in (("source", lambda r: r["source"]), ("nodes", lambda r: f"{r['device']} x{r['nodes']}"),
                       ("collective", lambda r: f"{r['collective']}{'' if r['nodes'] == 1 else ' xN'}")):
        for name, members in summary(out, key).items():
            print(f"{label:>9} {name:>16} {members['n']:>6} {members['median']:>14.1%} {members['max']:>11.1%} "
                  f"{members['within']:>7}/{members['n']:<3}  {members['signed']:>+7.1%}")
    everything = [abs(r["error"]) for r in out]
    print(f"all points: median |error| {statistics.median(everything):.1%}, max {max(everything):.1%}, "
          f"{sum(e <= 0.15 for e in everything)}/{len(everything)} within 15 % (goal)")
    print()
    for key, text in SOURCES.items():
        print(f"[{key}] {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
