// megaloop/loader_runs.cuh: which chunk list the weight ring's loader warp walks in a kernel of several
// programs (megaloop/plan/programs.py). Runs of different programs never overlap and the ring numbers
// chunks with one running count (megaloop/ring.cuh: ring_taken), so thread 0 tells the loader, in one
// word, each grant's program and the count at the grant's end; the loader keeps the run it walks.
// Plain arithmetic: tests/test_ring_loader.py runs it on the CPU against the consumers' numbering.
#pragma once
#include "megaloop/types.cuh"

namespace ml {

constexpr int RUN_PROGRAM_BITS = 8;  // the grant word: the count at its end, then the program below

// Thread 0, granting `iterations` iterations of `program` (its list: `chunks` chunks on this
// processor) once the ring took `taken` chunks: the word the loader reads.
__device__ __forceinline__ u64 run_grant(u64 taken, u64 iterations, int chunks, int program) {
    return (taken + iterations * (u64)chunks) << RUN_PROGRAM_BITS | (u64)program;
}

struct LoaderRun {
    u64 first;    // where the run's first iteration starts: chunk g is its list's entry (g - first) % n
    u64 end;      // the chunks granted so far: the loader issues those below
    int program;  // whose list
};

// The loader, every chunk below run.end issued, reads grant word `word`; true: another program's list.
// A grant of another program comes only once every chunk before it was consumed, so the new run
// starts at run.end (a run the loader never saw had no chunk here: its copies would have needed it).
__device__ __forceinline__ bool run_follow(LoaderRun& run, u64 word) {
    const int program = (int)(word & ((1u << RUN_PROGRAM_BITS) - 1));
    const bool switched = program != run.program;
    if (switched) {
        run.first = run.end;
        run.program = program;
    }
    run.end = word >> RUN_PROGRAM_BITS;
    return switched;
}

// chunk g's entry in the run's list of n > 0 chunks (g < run.first: some entry, never copied)
__device__ __forceinline__ int run_entry(const LoaderRun& run, u64 g, int n) { return (int)((g - run.first) % (u64)n); }

}  // namespace ml
