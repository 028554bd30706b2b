"""`numaov doctor`: what this machine offers numaov, and what to fix.

`collect_report()` returns a plain dict (the `--json` output; its keys are
listed in the README); `format_report()` turns it into text. Nothing here
prints.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numaov
from numaov import NumaovError
from numaov.runtime.placement.binding import BindingPlan
from numaov.runtime.placement.topology import Topology, format_cpu_list, read_topology

REPORT_KEYS = (
    "numaov_version", "python", "topology", "isa", "binding_plan", "openvino", "extension",
    "shm", "warnings",
)

TWO_RANKS = 2

_ISA_MEANING = {
    "amx_usable": "AMX tiles: OpenVINO runs bf16/int8 matmuls on the matrix units (fastest)",
    "avx512_bf16": "AVX512-BF16: OpenVINO runs bf16 matmuls with vector dot products",
    "avx512_vnni": "AVX512-VNNI: int8 dot products (OpenVINO's and numaov's int8 weights)",
    "avx512f": "AVX-512: fp32 kernels and fast fp32<->bf16 conversion",
    "avx2": "AVX2: baseline vector kernels",
}


def _isa_summary(topology: Topology) -> dict[str, Any]:
    isa = topology.isa
    if isa.amx_usable:
        bf16 = "bf16 matmuls on AMX (OpenVINO's default inference precision here is bf16)"
    elif isa.amx_tile:
        bf16 = ("the CPU has AMX but the kernel does not grant its tile state: bf16 matmuls fall "
                "back to AVX512-BF16" if isa.avx512_bf16 else "no bf16 matmul support usable")
    elif isa.avx512_bf16:
        bf16 = "bf16 matmuls on AVX512-BF16 (no AMX: several times slower than AMX machines)"
    else:
        bf16 = "no native bf16: OpenVINO computes in f32; bf16 models only save memory"
    return {
        "flags": isa.as_dict(),
        "meaning": {k: v for k, v in _ISA_MEANING.items() if getattr(isa, k)},
        "bf16_matmuls": bf16,
    }


def _type_name(value: Any) -> str:
    to_string = getattr(value, "to_string", None)
    return to_string() if callable(to_string) else str(value)


def _openvino_info() -> dict[str, Any]:
    try:
        import openvino as ov

        core = ov.Core()
        return {
            "version": ov.get_version(),
            "cpu": core.get_property("CPU", "FULL_DEVICE_NAME"),
            "cpu_capabilities": list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
            "default_inference_precision": _type_name(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
        }
    except Exception as exc:  # doctor reports, never crashes
        return {"error": f"OpenVINO is not usable: {exc}"}


def _extension_info() -> dict[str, Any]:
    try:
        import openvino as ov

        from numaov.native import add_extension, library_path

        path = library_path()
        add_extension(ov.Core())
        return {"path": str(path), "loads": True, "error": None, "attention": _attention_info(),
                "moe": _moe_info()}
    except Exception as exc:  # doctor reports, never crashes
        return {"path": None, "loads": False, "error": str(exc), "attention": None, "moe": None}


def _attention_info() -> dict[str, Any]:
    """Which kernel bf16 models' attention runs on, under NUMAOV_ATTENTION: ``kernel`` is
    "numaov", "openvino" or None (the setting is wrong: ``reason`` says why)."""
    from numaov.custom_ops.flash_attention import (
        amx_unavailable_reason,
        attention_kernel,
        attention_setting,
    )

    try:
        setting, kernel = attention_setting(), attention_kernel("bf16")
    except NumaovError as exc:
        return {"kernel": None, "setting": None, "reason": str(exc)}
    if kernel == "numaov":
        reason = "AMX is usable"
    else:
        reason = "as set" if setting == "openvino" else amx_unavailable_reason()
    return {"kernel": kernel, "setting": setting, "reason": reason}


def _moe_info() -> dict[str, Any]:
    """Which kernel the MoE experts op runs bf16 experts on, under NUMAOV_MOE_AMX:
    ``bf16_kernel`` "amx" (experts of ``amx_min_rows`` rows or more), "avx512_bf16" or None;
    and int8 ones, under NUMAOV_MOE_VNNI: ``int8_kernel`` "vnni", "f32" or None."""
    from numaov.custom_ops.moe_ops import MoeOpError, bf16_kernel, format_kernels, int8_kernel

    info: dict[str, Any] = {"formats": format_kernels()}
    try:
        kernel = bf16_kernel()
        info.update(bf16_kernel=kernel["kernel"], amx_min_rows=kernel["amx_min_rows"],
                    reason=kernel["reason"])
    except MoeOpError as exc:
        info.update(bf16_kernel=None, amx_min_rows=None, reason=str(exc))
    try:
        kernel = int8_kernel()
        info.update(int8_kernel=kernel["kernel"], int8_reason=kernel["reason"])
    except MoeOpError as exc:
        info.update(int8_kernel=None, int8_reason=str(exc))
    return info


def _shm_needed(world_size: int) -> int | None:
    try:
        from numaov.distributed.communicator import shm_bytes_needed
    except ImportError:
        return None
    return shm_bytes_needed(world_size)


def _expert_stores(model_dir: str | Path) -> list[dict[str, Any]]:
    """Each rank's expert store of the export in ``model_dir``: its file, bytes, layers and
    format, and on which NUMA nodes its pages are (a sample of pages, each read once: pages
    not yet in the page cache are read onto this process's node)."""
    from numaov.custom_ops.expert_store import open_store, store_nodes
    from numaov.runtime.manifest_reader import read_manifest

    manifest = read_manifest(model_dir, "lm")
    stores = []
    for rank in manifest.ranks:
        if rank.experts is None:
            continue
        store = open_store(rank.experts)
        formats = sorted({layer.plan.weight_format for layer in store.layers.values()})
        stores.append({"rank": rank.rank, "path": str(rank.experts), "bytes": store.bytes,
                       "layers": len(store.layers), "formats": formats,
                       "page_nodes": {str(k): v for k, v in store_nodes(store).items()}})
    return stores


def _wan_graphs(model_dir: str | Path) -> dict[str, Any]:
    """Each graph of a Wan export by name: a pipeline's components, or the bare graph."""
    from numaov.manifest import PIPELINE_KIND
    from numaov.runtime.manifest_reader import read_manifest

    top = read_manifest(model_dir)
    return ({name: read_manifest(top.directory / name) for name in top.record.components}
            if top.kind == PIPELINE_KIND
            else {"transformer" if top.kind == "wan" else top.kind: top})


def _wan_components(graphs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each graph of a Wan export (``_wan_graphs``): its IR weights and what a run holds for
    them once compiled (``COMPILED_WEIGHTS_FACTOR``, the factor ``run wan``'s memory estimate
    uses; the run reports what each really held)."""
    from numaov.runtime.wan.memory import COMPILED_WEIGHTS_FACTOR, graph_weight_bytes

    return [{"component": name, "precision": graph.record.precision,
             "weights_bytes": graph_weight_bytes(graph),
             "compiled_bytes": int(graph_weight_bytes(graph) * COMPILED_WEIGHTS_FACTOR)}
            for name, graph in graphs.items()]


def _wan_splits(graphs: dict[str, Any], topology: Topology,
                env: dict[str, str] | None) -> dict[str, Any]:
    """How ``run wan --workers N --parallel ...`` would place one video of this export on this
    machine: the rank counts every transformer has a split graph for (``sequence_graphs``),
    and per split it can run, which worker runs which branch and token share on which CPUs."""
    from numaov.runtime.placement.topology import format_cpu_list
    from numaov.runtime.wan.parallel import choose_split, exported_shares

    experts = [graph for name, graph in graphs.items() if name.startswith("transformer")]
    counts = (sorted(set.intersection(*(set(exported_shares(m)) for m in experts)))
              if experts else [])
    splits = []
    for workers, parallel in [(2, "guidance"), *((n, "sequence") for n in counts),
                              *((2 * n, "both") for n in counts)]:
        row: dict[str, Any] = {"workers": workers, "parallel": parallel}
        try:
            plan = BindingPlan.resolve(topology, workers, env)
            row["placement"] = choose_split(workers, parallel, guided=True).describe(
                None, [format_cpu_list(r.cpus) for r in plan.ranks])
        except NumaovError as exc:
            row["error"] = str(exc)
        splits.append(row)
    return {"sequence_graphs": counts, "splits": splits}


def _model_report(model_dir: str | Path, topology: Topology,
                  env: dict[str, str] | None) -> dict[str, Any]:
    """``expert_stores`` for a language-model export, ``wan_components`` and ``wan_splits``
    for a Wan one."""
    from numaov.manifest import LM_KIND, PIPELINE_KIND, ExportManifest

    kind = ExportManifest.read(model_dir).kind
    if kind == LM_KIND:
        return {"expert_stores": _expert_stores(model_dir)}
    graphs = _wan_graphs(model_dir)
    report: dict[str, Any] = {"wan_components": _wan_components(graphs)}
    if kind in ("wan", PIPELINE_KIND):  # what has a transformer to split
        report["wan_splits"] = _wan_splits(graphs, topology, env)
    return report


def collect_report(topology: Topology | None = None, env: dict[str, str] | None = None,
                   model_dir: str | Path | None = None) -> dict:
    """The report ``numaov doctor`` prints; with ``model_dir`` also each rank's expert store
    (``expert_stores``, a language-model export) or each graph's weights and what it holds
    compiled (``wan_components``, a Wan export)."""
    topology = topology or read_topology()
    warnings: list[str] = list(topology.assumptions)

    plan_info: dict[str, Any]
    world_size = 1
    try:
        plan = BindingPlan.resolve(topology, env=env)
        world_size = plan.world_size
        plan_info = {"source": plan.source, "ranks": plan.describe()}
        warnings += plan.warnings(topology)
    except NumaovError as exc:
        plan_info = {"error": str(exc)}
        warnings.append(f"no usable binding plan: {exc}")
    else:
        # What the same rule gives a command with two workers (a dp=2 model, the two
        # guidance branches of Wan): on a one-node machine, the allowed CPUs split in two.
        try:
            two = BindingPlan.resolve(topology, TWO_RANKS, env)
            plan_info["two_ranks"] = {"source": two.source, "ranks": two.describe()}
        except NumaovError as exc:
            plan_info["two_ranks"] = {"error": str(exc)}

    shm = topology.shm
    needed = _shm_needed(max(world_size, 2))
    if shm.free_bytes is None:
        warnings.append(f"{shm.path} is not available: the shared-memory collectives cannot run")
    elif needed is not None and shm.free_bytes < needed:
        warnings.append(
            f"{shm.path} has {shm.free_bytes / 2**20:.0f} MiB free but a {max(world_size, 2)}-rank "
            f"group needs {needed / 2**20:.0f} MiB; enlarge it (e.g. docker --shm-size)"
        )

    extension = _extension_info()
    if not extension["loads"]:
        warnings.append(f"the numaov extension does not load: {extension['error']}")
    elif extension["attention"]["kernel"] is None:
        warnings.append(extension["attention"]["reason"])
    openvino_info = _openvino_info()
    if "error" in openvino_info:
        warnings.append(openvino_info["error"])

    report = {
        "numaov_version": numaov.__version__,
        "python": platform.python_version(),
        "topology": {
            "numa_nodes": [
                {"id": n.id, "cpus": format_cpu_list(n.cpus),
                 "physical_cores": format_cpu_list(n.physical_cores),
                 "memory_bytes": n.memory_bytes}
                for n in topology.nodes
            ],
            "physical_cores": len(topology.physical_cores),
            "online_cpus": format_cpu_list(topology.online_cpus),
            "allowed_cpus": format_cpu_list(topology.allowed_cpus),
            "assumptions": list(topology.assumptions),
        },
        "isa": _isa_summary(topology),
        "binding_plan": plan_info,
        "openvino": openvino_info,
        "extension": extension,
        "shm": {"path": shm.path, "total_bytes": shm.total_bytes, "free_bytes": shm.free_bytes,
                "needed_bytes": needed},
        "warnings": warnings,
    }
    if model_dir is not None:
        report.update(_model_report(model_dir, topology, env))
    return report


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:,.0f} MiB"


def _plan_lines(plan: dict, indent: str) -> list[str]:
    if "error" in plan:
        return [f"{indent}none: {plan['error']}"]
    return [f"{indent}source: {plan['source']}"] + [
        f"{indent}rank {r['rank']}: CPUs {r['cpus']}, NUMA node(s) "
        f"{','.join(map(str, r['nodes']))}, {r['threads']} thread(s)"
        for r in plan["ranks"]
    ]


def format_report(report: dict) -> str:
    topo, isa, ov = report["topology"], report["isa"], report["openvino"]
    lines = [f"numaov {report['numaov_version']} (Python {report['python']})", "", "Topology"]
    lines.append(f"  {len(topo['numa_nodes'])} NUMA node(s), {topo['physical_cores']} physical "
                 f"core(s); allowed CPUs {topo['allowed_cpus']}")
    for node in topo["numa_nodes"]:
        lines.append(f"  node {node['id']}: CPUs {node['cpus']}, physical cores "
                     f"{node['physical_cores']}, memory {_mib(node['memory_bytes'])}")
    lines += ["", "ISA"]
    flags = isa["flags"]
    lines.append("  " + "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items()))
    lines.append(f"  bf16: {isa['bf16_matmuls']}")
    lines += ["", "Binding plan"]
    plan = report["binding_plan"]
    lines += _plan_lines(plan, "  ")
    if "two_ranks" in plan:
        lines.append(f"  for {TWO_RANKS} ranks:")
        lines += _plan_lines(plan["two_ranks"], "    ")
    lines += ["", "OpenVINO"]
    if "error" in ov:
        lines.append(f"  {ov['error']}")
    else:
        lines.append(f"  {ov['version']} on {ov['cpu']}")
        lines.append(f"  capabilities: {', '.join(ov['cpu_capabilities'])}; default inference "
                     f"precision {ov['default_inference_precision']}")
    ext = report["extension"]
    lines.append(f"  numaov extension: {'loads' if ext['loads'] else 'FAILS'} "
                 f"({ext['path'] or ext.get('error')})")
    attention = ext["attention"]
    if attention and attention["kernel"]:
        lines.append(f"  bf16 attention: {attention['kernel']}'s (NUMAOV_ATTENTION="
                     f"{attention['setting']}: {attention['reason']})")
    elif attention:
        lines.append(f"  bf16 attention: unknown ({attention['reason']})")
    moe = ext.get("moe")
    for weight_format, kernel in (moe or {}).get("formats", {}).items():
        reason = f" ({kernel['reason']})" if kernel["reason"] else ""
        lines.append(f"  {weight_format} MoE experts: {kernel['kernel'] or 'cannot run'}{reason}")
    shm = report["shm"]
    lines += ["", f"Shared memory: {shm['path']} {_mib(shm['free_bytes'])} free of "
              f"{_mib(shm['total_bytes'])}"
              + (f" (a group needs {_mib(shm['needed_bytes'])})" if shm["needed_bytes"] else "")]
    if "expert_stores" in report:
        lines += ["", "Expert stores"]
        lines += [f"  rank {s['rank']}: {s['path']}: {s['bytes'] / 2**30:.2f} GiB, {s['layers']} "
                  f"MoE layers ({', '.join(s['formats'])}); sampled pages by NUMA node: "
                  + ", ".join(f"node {n}: {c}" if n != "-1" else f"unreadable: {c}"
                              for n, c in s["page_nodes"].items())
                  for s in report["expert_stores"]] or ["  none (the export has no routed experts)"]
    if "wan_components" in report:
        lines += ["", "Wan graphs (IR weights; held once compiled and run, estimated)"]
        lines += [f"  {c['component']}: {_mib(c['weights_bytes'])} {c['precision']}; about "
                  f"{_mib(c['compiled_bytes'])} held" for c in report["wan_components"]]
    if "wan_splits" in report:
        splits = report["wan_splits"]
        lines += ["", "One video over workers (run wan --workers N --parallel ...; sequence "
                  "graphs for " + (", ".join(map(str, splits["sequence_graphs"])) or "no")
                  + " workers)"]
        lines += [f"  --workers {s['workers']} --parallel {s['parallel']}: "
                  + s.get("placement", s.get("error", "")) for s in splits["splits"]]
    lines += ["", "Warnings" if report["warnings"] else "No warnings."]
    lines += [f"  - {w}" for w in report["warnings"]]
    return "\n".join(lines)
