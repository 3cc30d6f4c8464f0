// A 64-bit checksum of a byte range, and parallel first touch of fresh memory (packed-weight cache reads).
// The checksum:, computed in the worker pool at memory speed: a packed-weight cache checks
// its files with it at every start, so it must cost a fraction of reading them. Not cryptographic: it detects
// truncation, torn writes and flipped bits, not tampering.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kt {

// The same value for the same bytes on every host, thread count and ISA (chunks of 4 MiB hashed independently,
// then combined in order).
uint64_t checksum(const uint8_t* p, size_t n);

// Writes zeros over [p, p + n) from the worker pool, 2 MiB at a time: the pages of fresh memory are faulted in by
// the kernel's own (possibly pinned, so NUMA-local) threads, in parallel, before a read fills them; an O_DIRECT
// read into unfaulted memory faults its pages one by one and ran at a third of the disk's speed.
void prefault(uint8_t* p, size_t n);

}  // namespace kt
