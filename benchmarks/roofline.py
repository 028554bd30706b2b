"""A roofline for the MoeExperts op: the machine's limits and the op's share of them, in one run.

1. **Limits**, measured here on the rank's CPUs (default: the process's affinity; ``--threads``
   takes the first N), by a small C library this script compiles with the system compiler
   (``$CC`` or ``cc``) into ``benchmarks/out/`` (cached by the source's hash) and loads with
   ctypes, one thread pinned per CPU, all threads starting each pass together:

   - read bandwidth: each thread sums its own buffer (first touched by that thread) with
     64-byte AVX-512 loads; 4x the last-level cache in all and at least 1 GiB (at least 32 MiB
     a thread), swept until a pass takes ~0.1 s;
   - f32 FMA peak: 16 independent chains of ``vfmadd`` on registers only (256 multiply-adds an
     iteration);
   - AVX512-BF16 peak: the same with ``vdpbf16ps`` (512 multiply-adds an iteration), where the
     CPU has AVX512-BF16;
   - AMX bf16 / int8 tile peaks: four independent ``tdpbf16ps`` / ``tdpbssd`` accumulators on
     tiles loaded once (32,768 / 65,536 multiply-adds an iteration), where /proc/cpuinfo lists
     amx_tile and amx_bf16 / amx_int8 and Linux grants the tile state (``arch_prctl
     ARCH_REQ_XCOMP_PERM``); otherwise the reason is printed and recorded.

   Each on one core and on all of the rank's cores, every probe once per round, the order
   reversed every other round; medians and ranges over ``--rounds``.

2. **The op**: the ``MoeExperts`` op alone, reading its experts from an expert store (the
   store face the runtime uses), compiled as the runtime compiles it, for each store format of
   ``--formats``, on three layer shapes: DeepSeek-V2-Lite (hidden 2048, expert intermediate
   1408, 64 experts, top-6), DeepSeek-V3 (7168, 2048, 256 experts top-8: the store holds only
   ``--v3-experts`` of them, since only the selected experts' bytes count) and Qwen3-30B-A3B
   (2048, 768, 128 experts, top-8). Decode is one row (batch 1) on its top-k experts, and three
   rows per expert for batched decode (32 requests give each expert they hit 1.6-2.3 rows on
   these shapes); prefill is 64 and 256 rows, all routed to the same top-k experts, so each
   selected expert gets 64 or 256 rows. Successive calls take the next disjoint set of k experts (cycling over the
   store), so a call's weights were last read several calls ago and come from memory, not the
   cache, as in a model with many layers. Per call: the bytes it must read (the k selected
   experts' weights and scales in the format, as the store holds them) per second, as a share
   of the read bandwidth of all the rank's cores: each decode timing (calls repeated for as long as
   a read sample takes, so a first call's cold threads weigh little) is paired with a read
   sample taken just before it and a decode share is the median of the paired ratios (a
   shared VM's bandwidth moves by 2x between samples), prefill's against the median of those
   samples (the limits of part 1 are measured before); its multiply-adds (rows x k x 3 x
   hidden x intermediate) per second, as a share of the f32 FMA peak and of the peak of the
   instructions the kernel runs the format on (bf16: AMX tiles for experts of two rows or
   more where usable, else AVX512-BF16; fp8, compiled as a bf16 model runs it, the same from
   the kernel's ``fp8_tile_min_rows`` rows per expert (dequantized to bf16); int8 / int4,
   compiled so too, on AVX512-VNNI against quantized activations where the kernel runs them
   so (``moe_ops.int8_kernel``), else widened to f32 FMAs like fp8 below that); and the roofline: the time the larger of the two bounds allows over the time taken. An empty call
   (a model with the op's inputs returning x, compiled the same way) is timed in the same
   rounds: what one ``infer`` costs by itself (~60 us here: inputs set, threads woken, the
   output returned), which the op does not pay inside a model's step; ``op%read`` is the
   read share of the call less the empty one. The formats and cases of a shape are timed in
   alternating rounds (``benchmarks/moe.py``'s helpers); medians and ranges. The share of
   CPU time the hypervisor stole while each part ran (``/proc/stat``) is printed and recorded:
   a run with much stolen time is disturbed.

    python benchmarks/roofline.py [--rounds 3] [--threads N] [--formats bf16,int8,int4,fp8]
        [--shapes v2-lite,v3,qwen3] [--v3-experts 16] [--part all|limits]

With ``NUMAOV_MOE_ISA=avx2`` in the environment the op runs the AVX2 kernel (what CPUs without
AVX-512 run): its decode shares are comparable, its prefill has no measured peak.

Writes benchmarks/out/roofline.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from machine import cpu_model  # benchmarks/machine.py, beside this file
from moe import SEED, _timed, l3_bytes, log  # the MoE benchmark's timing helpers

OUT_DIR = Path(__file__).resolve().parent / "out"
OUT = OUT_DIR / "roofline.json"
#: Seconds a probe's pass is calibrated to.
PASS_S = 0.1
#: The read probe's buffer in all, at least: a streaming read must come from memory, and a VM's
#: guest sees only part of the host's caches. On the 2-vCPU "AMD EPYC" VM (32 MiB of L3 in
#: sysfs) a 128 MiB buffer (4x that L3) read 18% faster in median than 1 GiB, and up to 74
#: against 55 GB/s, in 30 alternating samples (benchmarks/RESULTS.md): partly from a cache.
READ_BYTES_MIN = 1 << 30
#: Decode rows per selected expert, each timed against a read sample: one request, and batched
#: decode (32 requests of top-8 give the 111 of Qwen3-30B-A3B's 128 experts they hit 2.3 rows
#: each on average, DeepSeek-V3's 161 of 256 1.6 each: tiles of two and three rows).
DECODE_ROWS = (1, 2, 3)
#: Prefill rows per selected expert.
PREFILL_ROWS = (64, 256)
DEFAULT_FORMATS = ("bf16", "int8", "int4", "fp8")

# -- 1. the machine's limits ------------------------------------------------------------------

PROBE_SOURCE = r"""
// The machine's limits, each on threads pinned one per CPU (benchmarks/roofline.py):
//   kind 0: a streaming read of a buffer per thread (64-byte AVX-512 loads, summed);
//   kind 1: f32 FMAs (16 independent chains of 16 lanes: 256 multiply-adds an iteration);
//   kind 2: AVX512-BF16 dot products (16 chains x 32: 512 an iteration);
//   kind 3: AMX bf16 tiles (4 accumulators x 16 x 16 x 32: 32768 an iteration);
//   kind 4: AMX int8 tiles (4 accumulators x 16 x 16 x 64: 65536 an iteration);
//   kind 5: AVX512-VNNI int8 dot products (16 chains x 64: 1024 an iteration).
// The compute loops touch registers (tiles) only. Each function that issues wide
// instructions carries its own target attribute, so the library loads on any x86-64 and the
// caller decides from the CPU's flags what may run.
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TARGET_AVX512 __attribute__((target("avx512f")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bf16")))
#define TARGET_VNNI __attribute__((target("avx512f,avx512vnni")))
#define TARGET_AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))

volatile double probe_sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// `sweeps` times the sum of `bytes` (a multiple of 512) as 64-bit lanes, 8 loads a step.
TARGET_AVX512 static double read_pass(const char* p, size_t bytes, long sweeps) {
    __m512i acc[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_si512();
    for (long s = 0; s < sweeps; ++s) {
        for (size_t i = 0; i < bytes; i += 512) {
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j)
                acc[j] = _mm512_add_epi64(acc[j], _mm512_load_si512((const void*)(p + i + 64 * j)));
        }
    }
    _Pragma("GCC unroll 8") for (int j = 1; j < 8; ++j) acc[0] = _mm512_add_epi64(acc[0], acc[j]);
    return (double)_mm512_reduce_add_epi64(acc[0]);
}

// acc = acc * 0.999 + 0.001 tends to 1: no overflow, no denormals. The chains start apart,
// or the compiler merges them into one.
TARGET_AVX512 static double fma_f32(long iters) {
    __m512 acc[16];
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(0.01f * (float)j);
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
    for (long i = 0; i < iters; ++i) {
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
    }
    _Pragma("GCC unroll 16") for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
    return (double)_mm512_reduce_add_ps(acc[0]);
}

// The sums grow by 32e-6 a step: far from overflow in any pass timed here.
TARGET_BF16 static double dot_bf16(long iters) {
    __m512 acc[16];
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(0.01f * (float)j);
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    for (long i = 0; i < iters; ++i) {
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
    }
    _Pragma("GCC unroll 16") for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
    return (double)_mm512_reduce_add_ps(acc[0]);
}

// u8 1 times s8 1, four to a lane: the int32 sums grow by 4 a step (they wrap, at no cost).
TARGET_VNNI static double dot_vnni(long iters) {
    __m512i acc[16];
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_epi32(j);
    const __m512i a = _mm512_set1_epi8(1);
    for (long i = 0; i < iters; ++i) {
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, a);
    }
    _Pragma("GCC unroll 16") for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_epi32(acc[0], acc[j]);
    return (double)_mm512_reduce_add_epi32(acc[0]);
}

#ifndef PROBE_NO_AMX
// Every tile 16 rows of 64 bytes. A constant in memory: GCC 12 drops stores to a local
// configuration before ldtilecfg (numaov/custom_ops/csrc/common/amx.cpp).
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));
static const struct tile_config kTiles = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64},
                                          {16, 16, 16, 16, 16, 16, 16, 16}};

// Tiles 0-3 accumulate; 4-5 and 6-7 are the operands: four independent products a step.
// Operand bytes 0x3c: bf16 0.0115 (normal), int8 60 (int32 sums wrap, at no cost).
TARGET_AMX static double amx_loop(long iters, int int8) {
    uint8_t operand[1024] __attribute__((aligned(64)));
    float result[256] __attribute__((aligned(64)));
    memset(operand, 0x3c, sizeof operand);
    __asm__ volatile("" ::: "memory");  // the tile loads read operand behind GCC's back
    _tile_loadconfig(&kTiles);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64);
    _tile_loadd(7, operand, 64);
    for (long i = 0; i < iters; ++i) {
        if (int8) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, result, 64);
    __asm__ volatile("" ::: "memory");  // the tile store writes result behind GCC's back
    _tile_release();
    return (double)result[0];
}

// Linux grants the tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA): 0, or the errno of the refusal.
int probe_request_amx(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : errno; }
#else
static double amx_loop(long iters, int int8) { return (double)(iters + int8); }
int probe_request_amx(void) { return ENOSYS; }
#endif

struct shared {
    int kind, threads, passes;
    size_t bytes;
    long iters;
    pthread_mutex_t lock;
    pthread_cond_t ready;
    int go;  // 0: wait; 1: run; -1: give up (a thread could not be started)
    pthread_barrier_t barrier;
    double *start, *end;  // [passes][threads]
};

struct worker {
    struct shared* s;
    int index, cpu, error;
    double sink;
};

static void* run_worker(void* arg) {
    struct worker* w = arg;
    struct shared* s = w->s;
    pthread_mutex_lock(&s->lock);
    while (s->go == 0) pthread_cond_wait(&s->ready, &s->lock);
    const int go = s->go;
    pthread_mutex_unlock(&s->lock);
    if (go < 0) return NULL;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(w->cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) w->error = 1;
    char* buffer = NULL;
    if (s->kind == 0 && !w->error) {
        buffer = aligned_alloc(4096, s->bytes);
        if (buffer) {
            memset(buffer, 1, s->bytes);  // first touch: the pages on this thread's node
        } else {
            w->error = 2;
        }
    }
    for (int p = 0; p < s->passes; ++p) {  // every thread takes part in every barrier
        pthread_barrier_wait(&s->barrier);
        const double t0 = now();
        if (!w->error) {
            switch (s->kind) {
                case 0: w->sink += read_pass(buffer, s->bytes, s->iters); break;
                case 1: w->sink += fma_f32(s->iters); break;
                case 2: w->sink += dot_bf16(s->iters); break;
                case 3: w->sink += amx_loop(s->iters, 0); break;
                case 4: w->sink += amx_loop(s->iters, 1); break;
                default: w->sink += dot_vnni(s->iters); break;
            }
        }
        s->start[p * s->threads + w->index] = t0;
        s->end[p * s->threads + w->index] = now();
    }
    free(buffer);
    return NULL;
}

// Runs `kind` on one thread per CPU of cpus[0 .. threads), `passes` times, the threads
// starting each pass together; seconds[p] is pass p's span from the first start to the last
// end. `iters`: iterations (sweeps of the buffer for kind 0). Returns 0, or 1 (a thread could
// not be pinned), 2 (no memory), 3 (a thread could not be started).
int probe_run(int kind, const int* cpus, int threads, size_t bytes, long iters, int passes,
              double* seconds) {
    struct shared s;
    memset(&s, 0, sizeof s);
    s.kind = kind;
    s.threads = threads;
    s.passes = passes;
    s.bytes = bytes;
    s.iters = iters;
    s.start = calloc((size_t)passes * threads, sizeof(double));
    s.end = calloc((size_t)passes * threads, sizeof(double));
    struct worker* workers = calloc((size_t)threads, sizeof(struct worker));
    pthread_t* ids = calloc((size_t)threads, sizeof(pthread_t));
    int error = 0;
    if (!s.start || !s.end || !workers || !ids) {
        error = 2;
    } else {
        pthread_mutex_init(&s.lock, NULL);
        pthread_cond_init(&s.ready, NULL);
        pthread_barrier_init(&s.barrier, NULL, (unsigned)threads);
        int started = 0;
        for (; started < threads; ++started) {
            workers[started] = (struct worker){&s, started, cpus[started], 0, 0.0};
            if (pthread_create(&ids[started], NULL, run_worker, &workers[started]) != 0) break;
        }
        pthread_mutex_lock(&s.lock);  // all started: run; else the started ones give up
        s.go = started == threads ? 1 : -1;
        pthread_cond_broadcast(&s.ready);
        pthread_mutex_unlock(&s.lock);
        for (int t = 0; t < started; ++t) pthread_join(ids[t], NULL);
        pthread_barrier_destroy(&s.barrier);
        pthread_cond_destroy(&s.ready);
        pthread_mutex_destroy(&s.lock);
        if (started < threads) error = 3;
        for (int t = 0; t < started; ++t) {
            if (workers[t].error && !error) error = workers[t].error;
            probe_sink += workers[t].sink;
        }
        for (int p = 0; p < passes && !error; ++p) {
            double first = s.start[p * threads], last = s.end[p * threads];
            for (int t = 1; t < threads; ++t) {
                if (s.start[p * threads + t] < first) first = s.start[p * threads + t];
                if (s.end[p * threads + t] > last) last = s.end[p * threads + t];
            }
            seconds[p] = last - first;
        }
    }
    free(s.start);
    free(s.end);
    free(workers);
    free(ids);
    return error;
}
"""


@dataclasses.dataclass(frozen=True)
class Probe:
    """One limit: the C kind, what a unit of it is and how much an iteration does."""

    kind: int
    unit: str  # "GB/s" or "GMAC/s" (10^9 multiply-adds a second)
    per_iteration: float  # multiply-adds an iteration (compute probes)
    needs: tuple[str, ...]  # /proc/cpuinfo flags


PROBES = {
    "read": Probe(0, "GB/s", 0, ("avx512f",)),
    "fma_f32": Probe(1, "GMAC/s", 16 * 16, ("avx512f",)),
    "dot_bf16": Probe(2, "GMAC/s", 16 * 32, ("avx512f", "avx512_bf16")),
    "amx_bf16": Probe(3, "GMAC/s", 4 * 16 * 16 * 32, ("amx_tile", "amx_bf16")),
    "amx_int8": Probe(4, "GMAC/s", 4 * 16 * 16 * 64, ("amx_tile", "amx_int8")),
    "dot_vnni": Probe(5, "GMAC/s", 16 * 64, ("avx512f", "avx512_vnni")),
}


class ProbeLibrary:
    """The compiled probes (``PROBE_SOURCE``), and why AMX cannot be probed ("" when it can)."""

    def __init__(self) -> None:
        compiler = os.environ.get("CC", "cc")
        digest = hashlib.sha256(f"{compiler}\n{PROBE_SOURCE}".encode()).hexdigest()[:16]
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        path = OUT_DIR / f"roofline-probes-{digest}.so"
        fallback = OUT_DIR / f"roofline-probes-{digest}-noamx.so"
        reason = fallback.with_suffix(".reason")
        if not path.is_file() and not fallback.is_file():
            source = path.with_suffix(".c")
            source.write_text(PROBE_SOURCE)
            error = self._compile(compiler, source, path, [])
            if error:  # a compiler without the AMX intrinsics: the rest still builds
                fallback_error = self._compile(compiler, source, fallback, ["-DPROBE_NO_AMX"])
                if fallback_error:
                    raise RuntimeError(f"roofline probes: {compiler} could not build {source}: "
                                       f"{fallback_error}")
                reason.write_text(error)
        self.amx_build_reason = ""
        if not path.is_file():
            path = fallback
            self.amx_build_reason = (f"{compiler} cannot compile the AMX intrinsics "
                                     f"({reason.read_text()[:200]})")
        self.lib = ctypes.CDLL(str(path))
        self.lib.probe_run.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                       ctypes.c_size_t, ctypes.c_long, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_double)]
        self.lib.probe_run.restype = ctypes.c_int
        self.lib.probe_request_amx.restype = ctypes.c_int
        self.path = path

    @staticmethod
    def _compile(compiler: str, source: Path, out: Path, extra: list[str]) -> str:
        """"" when it built, else the compiler's last lines."""
        partial = out.with_name(f"{out.name}.{os.getpid()}")  # another run may build it too
        command = [compiler, "-O2", "-Wall", "-shared", "-fPIC", "-pthread", *extra,
                   str(source), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            partial.replace(out)
            return ""
        return " ".join(done.stderr.strip().splitlines()[-3:]) or f"exit {done.returncode}"

    def run(self, probe: Probe, cpus: list[int], bytes_per_thread: int, iters: int,
            passes: int = 2) -> list[float]:
        """Seconds of each pass (every thread starting it together)."""
        cpu_array = (ctypes.c_int * len(cpus))(*cpus)
        seconds = (ctypes.c_double * passes)()
        error = self.lib.probe_run(probe.kind, cpu_array, len(cpus), bytes_per_thread, iters,
                                   passes, seconds)
        if error:
            what = {1: "a thread could not be pinned to its CPU", 2: "out of memory",
                    3: "a thread could not be started"}.get(error, f"error {error}")
            raise RuntimeError(f"roofline probe {probe.kind} on CPUs {cpus}: {what}")
        return list(seconds)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unavailable(name: str, flags: set[str], library: ProbeLibrary, amx_errno: int | None
                ) -> str:
    """Why probe ``name`` cannot run here ("" when it can)."""
    missing = [flag for flag in PROBES[name].needs if flag not in flags]
    if missing:
        return f"the CPU ({cpu_model()}) has no {', '.join(missing)} (/proc/cpuinfo flags)"
    if name.startswith("amx"):
        if library.amx_build_reason:
            return library.amx_build_reason
        if amx_errno:
            return (f"Linux refused this process the AMX tile state (arch_prctl "
                    f"ARCH_REQ_XCOMP_PERM: {os.strerror(amx_errno)}; Linux 5.16+ needed)")
    return ""


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def read_bytes_per_thread(threads: int, llc_bytes: int | None) -> int:
    """The read probe's buffer per thread: 4x the last-level cache in all and at least
    READ_BYTES_MIN, split over the threads (at least 32 MiB each when there are several), in
    whole pages."""
    total = max(4 * (llc_bytes or 64 << 20), READ_BYTES_MIN)
    size = total if threads == 1 else max(-(-total // threads), 32 << 20)
    return -(-size // 4096) * 4096


class ReadSampler:
    """The read probe on all of ``cpus``, one ~PASS_S pass a sample. Sampled in every round
    of the op, so a share compares the op with the bandwidth the machine gave in the same
    minutes (a shared VM's bandwidth moves by 2x within minutes)."""

    def __init__(self, cpus: list[int], llc_bytes: int | None) -> None:
        self.library, self.cpus = ProbeLibrary(), cpus
        self.size = read_bytes_per_thread(len(cpus), llc_bytes)
        seconds = self.library.run(PROBES["read"], cpus, self.size, 1)[-1]
        self.iters = max(1, round(PASS_S / max(seconds, 1e-6)))

    def sample(self) -> float:
        """GB/s of one pass (after a warm-up pass)."""
        seconds = self.library.run(PROBES["read"], self.cpus, self.size, self.iters)[-1]
        return len(self.cpus) * self.size * self.iters / seconds / 1e9


def cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU time of the machine so far, in clock ticks (/proc/stat): the share the
    hypervisor gave other guests between two readings says how disturbed a measurement was."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(fields), fields[7]


def stolen_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[0] - before[0]
    return (after[1] - before[1]) / total if total else 0.0


def measure_limits(cpus: list[int], rounds: int, llc_bytes: int | None) -> dict[str, Any]:
    """Each limit of ``PROBES`` the CPU has, on ``cpus[:1]`` (``one_core``) and on all of
    ``cpus`` (``all_cores``): ``{"limits": {name: {"unit", "one_core": stats, "all_cores":
    stats, ...}}, "not_measured": {name: reason}}``; stats are medians and ranges over
    ``rounds``, each probe sampled once a round, the order reversed every other round."""
    library = ProbeLibrary()
    flags = cpu_flags()
    amx_errno = None
    if {"amx_tile"} <= flags and not library.amx_build_reason:
        amx_errno = library.lib.probe_request_amx()
    not_measured = {name: reason for name in PROBES
                    if (reason := unavailable(name, flags, library, amx_errno))}
    names = [name for name in PROBES if name not in not_measured]
    sizes = {"one_core": read_bytes_per_thread(1, llc_bytes),
             "all_cores": read_bytes_per_thread(len(cpus), llc_bytes)}
    configs = {"one_core": cpus[:1], "all_cores": cpus}
    iters: dict[str, int] = {}
    for name in names:  # calibrated on one core: a pass of ~PASS_S
        probe, trial = PROBES[name], 4 if name == "read" else 1 << 20
        seconds = library.run(probe, cpus[:1], sizes["one_core"], trial)[-1]
        iters[name] = max(1, round(trial * PASS_S / max(seconds, 1e-6)))
        if name == "read":  # the all-cores buffer is smaller per thread: as many bytes a pass
            iters["read_all"] = max(1, round(iters[name] * sizes["one_core"]
                                             / sizes["all_cores"] / len(cpus)))
    keys = [(name, config) for name in names for config in configs]
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    ticks = cpu_ticks()
    for round_number in range(rounds):
        for name, config in keys if round_number % 2 == 0 else keys[::-1]:
            probe, chosen = PROBES[name], configs[config]
            count = iters["read_all" if name == "read" and config == "all_cores" else name]
            seconds = library.run(probe, chosen, sizes[config], count)[-1]  # pass 0: warm-up
            if name == "read":
                samples[(name, config)].append(len(chosen) * sizes[config] * count / seconds / 1e9)
            else:
                samples[(name, config)].append(len(chosen) * count * probe.per_iteration
                                               / seconds / 1e9)
    limits: dict[str, Any] = {}
    for name in names:
        limits[name] = {"unit": PROBES[name].unit,
                        **{config: stats(samples[(name, config)]) for config in configs}}
        if name == "read":
            limits[name]["bytes_per_thread"] = sizes
    return {"cpus": cpus, "library": str(library.path), "limits": limits,
            "not_measured": not_measured, "stolen": stolen_share(ticks, cpu_ticks())}


def format_limits(measured: dict[str, Any]) -> str:
    lines = [f"{'limit':10s} {'unit':7s} {'one core, median [min-max]':>30s} "
             f"{'all ' + str(len(measured['cpus'])) + ' cores, median [min-max]':>34s}"]
    for name, limit in measured["limits"].items():
        cells = [f"{limit[c]['median']:8.1f} [{limit[c]['min']:.1f}-{limit[c]['max']:.1f}]"
                 for c in ("one_core", "all_cores")]
        lines.append(f"{name:10s} {limit['unit']:7s} {cells[0]:>30s} {cells[1]:>34s}")
    for name, reason in measured["not_measured"].items():
        lines.append(f"{name:10s} not measured: {reason}")
    lines.append(f"CPU time stolen by the hypervisor while measuring: "
                 f"{100 * measured['stolen']:.0f}%")
    return "\n".join(lines)


def compute_peak(measured: dict[str, Any], weights: str, rows_per_expert: float
                 ) -> tuple[str, float] | None:
    """The measured multiply-add peak (all cores, median) of the instructions the MoeExperts
    kernel runs ``weights`` on at this many rows per expert: bf16 on AMX tiles where the kernel
    puts such an expert on them (``moe_ops.bf16_kernel``), else AVX512-BF16 dot products;
    fp8 as bf16 from the kernel's ``fp8_tile_min_rows`` rows per expert (the op is compiled
    as a bf16 model runs it, `stored_op`); int8 and int4, compiled so too, on AVX512-VNNI dot
    products where the kernel runs them so (``moe_ops.int8_kernel``); f32, and int8, int4 and
    fp8 otherwise, in f32 FMAs (weight-only: the weights are widened to f32). None when that peak was not measured, or the
    kernel runs on AVX2 (``NUMAOV_MOE_ISA``: its 8-lane FMAs' peak is not one of the probes)."""
    from numaov.custom_ops.moe_ops import bf16_kernel, int8_kernel, kernel_isa

    if kernel_isa(weights) == "avx2":
        return None
    name = "fma_f32"
    kernel = bf16_kernel()
    fp8_tiles = kernel["fp8_tile_min_rows"]
    if weights == "bf16" or (weights == "fp8" and fp8_tiles and rows_per_expert >= fp8_tiles):
        on_tiles = kernel["kernel"] == "amx" and rows_per_expert >= (kernel["amx_min_rows"] or 1)
        name = "amx_bf16" if on_tiles else "dot_bf16"
    if weights in ("int8", "int4") and int8_kernel()["kernel"] == "vnni":
        name = "dot_vnni"
    limit = measured["limits"].get(name)
    return (name, limit["all_cores"]["median"]) if limit else None


# -- 2. the op against the limits -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A model's routed-expert layer; ``stored`` experts go into the benchmark's store."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    stored: int


SHAPES = {
    "v2-lite": LayerShape("DeepSeek-V2-Lite", 2048, 1408, 64, 6, 64),
    "v3": LayerShape("DeepSeek-V3", 7168, 2048, 256, 8, 16),
    "qwen3": LayerShape("Qwen3-30B-A3B", 2048, 768, 128, 8, 128),
}


def stored_op(shape: LayerShape, formats: list[str], threads: int, where: Path
              ) -> dict[str, tuple[Any, int]]:
    """Per format: the op compiled as the runtime compiles it over a store of ``shape.stored``
    seeded experts in that format, and the bytes one expert takes there (weights and
    scales)."""
    from numaov.custom_ops import compile_ir
    from numaov.custom_ops.expert_store import STORE_NAME, open_store, write_stacks
    from numaov.custom_ops.moe_ops import write_store_moe_onnx
    from numaov.exporter.openvino_convert import convert_to_ir
    from numaov.exporter.weight_formats import expert_group_size

    g = torch.Generator().manual_seed(SEED)
    e, h, i = shape.stored, shape.hidden, shape.inter
    gate_up = torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)
    down = torch.randn(e, h, i, generator=g) / math.sqrt(i)
    built: dict[str, tuple[Any, int]] = {}
    for weights in formats:
        log(f"  {shape.name}: a store of {e} experts in {weights}")
        directory = where / weights
        store_path = directory / STORE_NAME
        write_stacks(store_path, {0: (gate_up, down)}, weights,
                     expert_group_size(weights, h, i))
        store = open_store(store_path)  # the op reads the store this process opened
        per_expert = store.layers[0].plan.expert_bytes()
        onnx_path = write_store_moe_onnx(directory / "moe.onnx", STORE_NAME, store.store_id,
                                         0, h, shape.top_k)
        # fp8, int8 and int4 as a bf16 model runs them: fp8's prefill on the bf16 tiles (decode
        # is exact either way), int8 and int4 on VNNI against quantized activations (int8_kernel)
        precision = "bf16" if weights in ("bf16", "fp8", "int8", "int4") else "f32"
        xml = convert_to_ir(onnx_path, directory / "moe.xml", precision)
        request = compile_ir(xml, precision, {"INFERENCE_NUM_THREADS": threads}
                             ).create_infer_request()
        built[weights] = (request, per_expert)
    return built


def empty_call(shape: LayerShape, threads: int) -> Any:
    """A model with the op's inputs whose output is x itself, compiled as the op is: what one
    ``infer`` costs (inputs set, threads woken, output returned) without the op. In a model the
    op runs among the step's other nodes and pays none of it, so the op's own time is a call's
    minus this one, timed in the same rounds."""
    import openvino as ov

    from numaov.custom_ops import compile_ir

    opset = ov.opset13
    x = opset.parameter([-1, shape.hidden], np.float32, name="x")
    ids = opset.parameter([-1, shape.top_k], np.int64, name="ids")
    weights = opset.parameter([-1, shape.top_k], np.float32, name="weights")
    y = opset.multiply(x, np.float32(1))
    model = ov.Model([y], [x, ids, weights], "empty")
    return compile_ir(model, "f32", {"INFERENCE_NUM_THREADS": threads}).create_infer_request()


def routed_feeds(shape: LayerShape, rows_per_expert: int) -> list[dict[str, np.ndarray]]:
    """One input per disjoint set of ``top_k`` stored experts: ``rows_per_expert`` rows, each
    routed to every expert of the set."""
    rng = np.random.default_rng(SEED)
    k = shape.top_k
    x = rng.standard_normal((rows_per_expert, shape.hidden), dtype=np.float32)
    weights = rng.random((rows_per_expert, k), dtype=np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return [{"x": x, "ids": np.tile(np.arange(s * k, s * k + k), (rows_per_expert, 1)),
             "weights": weights} for s in range(max(1, shape.stored // k))]


def cycling(request: Any, feeds: list[dict[str, np.ndarray]]) -> Callable[[], None]:
    """A call that infers the next feed each time."""
    order = itertools.cycle(feeds)
    return lambda: request.infer(next(order))


def shares(measured: dict[str, Any], read: float | None, weights: str, rows_per_expert: int,
           nbytes: float, macs: float, seconds: float, op_seconds: float | None = None
           ) -> dict[str, Any]:
    """A call's bytes and multiply-adds per second against the measured limits (all cores;
    ``read``: the read bandwidth to compare with, None when not measured), and its roofline:
    the time the binding limit allows over the time taken. ``op_seconds``: the call less an
    empty call (`empty_call`), whose bytes per second are also given as a share of the read
    bandwidth (``of_read_op``)."""
    limits = measured["limits"]
    fma = limits["fma_f32"]["all_cores"]["median"] if "fma_f32" in limits else None
    gb_s, gmac_s = nbytes / seconds / 1e9, macs / seconds / 1e9
    out: dict[str, Any] = {"gb_s": gb_s, "gmac_s": gmac_s,
                           "of_read": gb_s / read if read else None,
                           "of_fma_f32": gmac_s / fma if fma else None}
    if op_seconds is not None:
        out["op_gb_s"] = nbytes / op_seconds / 1e9
        out["of_read_op"] = out["op_gb_s"] / read if read else None
    if "amx_bf16" in limits:
        out["of_amx_bf16"] = gmac_s / limits["amx_bf16"]["all_cores"]["median"]
    peak = compute_peak(measured, weights, rows_per_expert)
    out["peak"] = peak[0] if peak else None
    out["of_peak"] = gmac_s / peak[1] if peak else None
    bounds = {}
    if read:
        bounds["read"] = nbytes / (read * 1e9)
    if peak:
        bounds[peak[0]] = macs / (peak[1] * 1e9)
    if bounds:
        out["bound"] = max(bounds, key=bounds.__getitem__)
        out["of_roofline"] = bounds[out["bound"]] / seconds
    return out


def moe_roofline(shape: LayerShape, formats: list[str], rounds: int, threads: int,
                 measured: dict[str, Any], reads: ReadSampler, tmp: Path
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every format at each decode and prefill row count, timed in alternating rounds: the
    rows, and the read samples and the share of CPU time stolen by the hypervisor while they
    ran. Each decode sample comes with a read sample taken just before it, and a decode row's
    read shares are the medians of the paired ratios (this VM's read bandwidth moves from 37
    to 82 GB/s between consecutive 0.1 s samples); a prefill row's (compute-bound) are
    against the median of the read samples."""
    built = stored_op(shape, formats, threads, tmp / shape.name)
    cases = (*DECODE_ROWS, *PREFILL_ROWS)
    feeds = {c: routed_feeds(shape, c) for c in cases}
    competitors = {(w, c): cycling(built[w][0], feeds[c]) for w in formats for c in cases}
    empty = empty_call(shape, threads)
    competitors.update({("empty", c): cycling(empty, feeds[c]) for c in cases})
    for weights in formats:  # warm-up: every stored expert read once (its pages mapped) ...
        for _ in feeds[1]:
            competitors[(weights, 1)]()
    for call in competitors.values():  # ... and every case called once
        call()
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in competitors}
    keys = list(competitors)
    paired: dict[tuple[str, int], list[float]] = {key: [] for key in competitors
                                                  if key[1] in DECODE_ROWS and key[0] != "empty"}
    ticks = cpu_ticks()
    for round_number in range(rounds):
        for key in keys if round_number % 2 == 0 else keys[::-1]:
            if key in paired:  # decode: calls for as long as the read sample took
                paired[key].append(reads.sample())
                samples[key].append(_timed(competitors[key], PASS_S))
            else:
                samples[key].append(_timed(competitors[key]))
    read_samples = [gb_s for values in paired.values() for gb_s in values]
    conditions = {"read_gb_s": stats(read_samples), "stolen": stolen_share(ticks, cpu_ticks())}
    read = conditions["read_gb_s"]["median"]
    rows = []
    for (weights, c), times in samples.items():
        if weights == "empty":
            continue
        per_expert = built[weights][1]
        nbytes = shape.top_k * per_expert
        macs = c * shape.top_k * 3 * shape.hidden * shape.inter
        seconds = statistics.median(times)
        empty_seconds = statistics.median(samples[("empty", c)])
        row = {"shape": shape.name, "hidden": shape.hidden, "inter": shape.inter,
               "experts": shape.experts, "stored_experts": shape.stored,
               "top_k": shape.top_k, "weights": weights, "rows_per_expert": c,
               "tokens": c, "bytes": nbytes, "macs": macs,
               "ms": {k: 1e3 * v for k, v in stats(times).items()},
               "empty_call_ms": 1e3 * empty_seconds,
               **shares(measured, read, weights, c, nbytes, macs, seconds,
                        seconds - empty_seconds)}
        if (weights, c) in paired:
            reads_gb_s = paired[(weights, c)]
            row["read_paired_gb_s"] = reads_gb_s
            row["of_read"] = statistics.median(
                nbytes / t / 1e9 / r for t, r in zip(times, reads_gb_s, strict=True))
            row["of_read_op"] = statistics.median(
                nbytes / (t - empty_seconds) / 1e9 / r
                for t, r in zip(times, reads_gb_s, strict=True))
            if row.get("bound") == "read":
                row["of_roofline"] = row["of_read"]
        rows.append(row)
    return rows, conditions


def format_conditions(shape: str, conditions: dict[str, Any]) -> str:
    read = conditions["read_gb_s"]
    return (f"{shape}: read during its rounds {read['median']:.1f} [{read['min']:.1f}-"
            f"{read['max']:.1f}] GB/s; CPU time stolen by the hypervisor "
            f"{100 * conditions['stolen']:.0f}%")


def _percent(value: float | None) -> str:
    return f"{100 * value:.0f}%" if value is not None else "-"


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':17s} {'format':6s} {'rows/e':>6s} {'ms median [min-max]':>24s} "
             f"{'MB':>7s} {'GB/s':>6s} {'%read':>6s} {'op%read':>7s} {'GMAC/s':>7s} "
             f"{'%fma32':>7s} {'%peak':>6s} {'peak':9s} {'bound':9s} {'%roof':>6s}"]
    for r in rows:
        t = r["ms"]
        lines.append(
            f"{r['shape']:17s} {r['weights']:6s} {r['rows_per_expert']:6d} "
            f"{t['median']:9.2f} [{t['min']:.2f}-{t['max']:.2f}]".ljust(56)
            + f" {r['bytes'] / 1e6:7.1f} {r['gb_s']:6.1f} {_percent(r['of_read']):>6s} "
            f"{_percent(r.get('of_read_op')):>7s} "
            f"{r['gmac_s']:7.1f} {_percent(r['of_fma_f32']):>7s} {_percent(r['of_peak']):>6s} "
            f"{r['peak'] or '-':9s} {r.get('bound', '-'):9s} "
            f"{_percent(r.get('of_roofline')):>6s}")
    return "\n".join(lines)


def load_average() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of the limits and of the op (medians, ranges)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the rank's cores: the first N CPUs of the process's affinity "
                             "(default: all of them)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help="store formats of the op (comma-separated: f32, bf16, int8, "
                             "int4, fp8)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"layer shapes (comma-separated: {', '.join(SHAPES)})")
    parser.add_argument("--v3-experts", type=int, default=SHAPES["v3"].stored,
                        help="experts in DeepSeek-V3's store (of 256; only the selected ones' "
                             "bytes count)")
    parser.add_argument("--part", choices=["all", "limits"], default="all",
                        help="the limits and the op (default), or the limits alone")
    args = parser.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    threads = args.threads or len(allowed)
    if not 1 <= threads <= len(allowed):
        parser.error(f"--threads {threads}; expected 1 .. {len(allowed)} (the process's CPUs)")
    cpus = allowed[:threads]
    os.sched_setaffinity(0, cpus)  # OpenVINO's threads and the probes on the same cores
    torch.set_num_threads(threads)
    formats = args.formats.split(",")
    shape_names = args.shapes.split(",")
    for name in shape_names:
        if name not in SHAPES:
            parser.error(f"--shapes: {name!r}; expected some of {', '.join(SHAPES)}")
    if args.v3_experts < SHAPES["v3"].top_k:
        parser.error(f"--v3-experts {args.v3_experts}; expected at least the top-k "
                     f"({SHAPES['v3'].top_k})")
    shapes = {**SHAPES, "v3": dataclasses.replace(SHAPES["v3"], stored=args.v3_experts)}
    llc = l3_bytes()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": cpu_model(), "cpus": cpus, "l3_bytes": llc,
                    "platform": platform.platform(), "python": sys.version.split()[0]},
        "load_average_start": load_average(),
        "command": " ".join(["python", "benchmarks/roofline.py", *sys.argv[1:]]),
    }
    log(f"{results['date']}, {cpu_model()}, CPUs {cpus}, load {results['load_average_start']}")
    log(f"limits: {args.rounds} rounds, one core and all {threads}")
    results["limits"] = measure_limits(cpus, args.rounds, llc)
    log(format_limits(results["limits"]))
    save(results)
    if args.part == "all":
        from numaov.custom_ops.moe_ops import bf16_kernel

        kernel = bf16_kernel()
        log(f"bf16 experts: {kernel['kernel']} ({kernel['reason']})")
        results["moe_bf16_kernel"] = kernel
        results["moe"] = []
        results["moe_conditions"] = {}
        reads = ReadSampler(cpus, llc)
        with tempfile.TemporaryDirectory(prefix="numaov-roofline-") as tmp:
            for name in shape_names:
                rows, conditions = moe_roofline(shapes[name], formats, args.rounds, threads,
                                                results["limits"], reads, Path(tmp))
                results["moe"] += rows
                results["moe_conditions"][shapes[name].name] = conditions
                log(format_rows(rows))
                log(format_conditions(shapes[name].name, conditions))
                save(results)
        log(f"MoeExperts op, {args.rounds} alternating rounds, shares of the limits' medians "
            f"on all {threads} cores (read: sampled in the op's rounds):")
        log(format_rows(results["moe"]))
        for name, conditions in results["moe_conditions"].items():
            log(format_conditions(name, conditions))
    results["load_average_end"] = load_average()
    log(f"load {results['load_average_end']}")
    save(results)


def save(results: dict[str, Any]) -> None:
    """Written after each part, so a later failure keeps what was measured."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
