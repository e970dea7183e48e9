// The emulator's side of loom/tile/emu_abi.h: the PTX instructions of
// loom/tile/ptx.h as the PTX ISA defines them (instructions.cpp).
#pragma once

#include <cstdint>

#include "loom/tile/emu_abi.h"

namespace loom::emu {

// The table bound into every emulated program (loom_emu_bind).
const Api& api();

// The shared address of element (mn, k) of a 16-bit wgmma operand described
// by the 64-bit matrix descriptor `desc`: K-major (mnMajor false) or
// MN-major, per the PTX ISA's canonical layouts, swizzle and base offset.
uint32_t descriptorAddress(uint64_t desc, bool mnMajor, int mn, int k);

}  // namespace loom::emu
