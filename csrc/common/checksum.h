// A 64-bit checksum of a byte range, computed in the worker pool at memory speed: a packed-weight cache checks
// its files with it at every start, so it must cost a fraction of reading them. Not cryptographic: it detects
// truncation, torn writes and flipped bits, not tampering.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kt {

// The same value for the same bytes on every host, thread count and ISA (chunks of 4 MiB hashed independently,
// then combined in order).
uint64_t checksum(const uint8_t* p, size_t n);

}  // namespace kt
