// The machine code as evidence: a cubin's SASS (nvdisasm's text) read into
// per-entry figures of each tensor-core loop, the innermost loop that holds
// HGMMA or HMMA instructions. The figures are static counts over the loop's
// body, what one warp issues per iteration (one key block) when every path
// of the body runs:
//
//   - instructions by class (tensor, MUFU.EX2, fp32, conversions, shuffles,
//     integer, uniform, sync, memory, local, branch, other);
//   - the tensor FLOP one warp's HGMMA / HMMA issue per iteration, and so
//     instructions per million tensor FLOP, which compares any tile;
//   - where the warpgroup waits sit relative to the exponentials: how many
//     MUFU.EX2 lie between the wait that retires S (wait_group 1) and the
//     wait that retires P V (wait_group 0), following the loop around;
//   - the named barriers (ids other than 0) synced and arrived at: a loop
//     that syncs one and arrives at another hands the tensor cores back and
//     forth between consumer warpgroups (ping-pong);
//   - local memory (LDL / STL).
//
// Loops are natural loops of the control-flow graph (a back edge whose
// target dominates its source), so an out-of-line retry of an mbarrier wait
// belongs to the loop it came from and is no loop of its own.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "loom/result.h"
#include "loom/v1/loom.pb.h"

namespace loom::jit::sass {

// Names what this reader counts: figures a cached artifact holds from
// another reader are taken again. Change it with any change to the figures.
inline constexpr const char* kReaderVersion = "sass-reader-2026-12-07-four-mask-selects";

// One instruction of nvdisasm's listing.
struct Instruction {
  int offset = 0;          // byte offset in the function
  std::string predicate;   // "@!P0", or empty
  std::string opcode;      // "HGMMA.64x128x16.F32.BF16"
  std::string operands;    // the rest, without the trailing ';'
  std::string target;      // a branch's label, or empty
  // An indirect branch's (BRX) labels, from nvdisasm's BRANCH_TARGETS note:
  // a switch's jump table.
  std::vector<std::string> switchTargets;
};

struct Function {
  std::string name;
  std::vector<Instruction> code;
  std::map<std::string, int> labels;  // label -> index of the instruction it names
};

// The functions of nvdisasm's listing (`nvdisasm -c`), in order.
std::vector<Function> parseListing(const std::string& text);

// The figures of `function`'s tensor-core loops, in address order, and its
// setmaxnreg requests (filled into `usage`'s loops and setmaxnreg).
void analyzeFunction(const Function& function, v1::ResourceUsage& usage);

// The class of an opcode, one of kClasses.
std::string classOf(const std::string& opcode);
inline constexpr const char* kClasses[] = {"tensor", "mufu_ex2", "mufu", "fp32", "conversion", "shuffle", "integer",
                                           "uniform", "sync", "memory", "local", "branch", "other"};

// The nvdisasm used: $LOOM_NVDISASM, else the project's own (scripts/setup
// installs it under .tools/), else one on PATH or in /usr/local/cuda/bin.
// Empty when there is none.
std::string nvdisasmPath();

// nvdisasm's listing of a cubin (code sections only).
Result<std::string> disassemble(const std::string& cubin);

// Disassembles `cubin` and fills the loop figures of every entry of
// `resources` it names (entries the listing adds are appended). An error
// when there is no nvdisasm or it fails; `resources` is then unchanged.
Status readLoops(const std::string& cubin, std::vector<v1::ResourceUsage>& resources);

// FlashAttention-3's loops read by this reader (docs/performance.md, The
// SASS budget: flash-attention 0251105a, bf16, causal, sm90, compiled with
// nvcc 13.0 and its own flags): instructions per million tensor FLOP of the
// unmasked and the masked loop. 0 where no anchor was measured.
double fa3PerTensorMflop(int headDim, bool masked);

// The gate CI holds every sm_90a default's attention loops to:
// FlashAttention-3's loops as the issue counts them, the loop's own text
// from its head to its back branch (without the out-of-line retry of the
// mbarrier wait this reader also counts), per million tensor FLOP: 447 /
// 588 (unmasked / masked) at head_dim 128, 822 / 1101 at 64; stricter than
// fa3PerTensorMflop. 0 where no gate is set for this head_dim.
double budgetPerTensorMflop(int headDim, bool masked);
// FlashAttention-2's unmasked loop as this reader counts it (flash-attention
// 0251105a, hdim 128 bf16 causal, 128 x 64 tiles of 4 warps, the A100 path;
// nvcc 13.0 with its setup.py flags): 914 instructions a warp a key block,
// per million tensor FLOP. The sm_80 gate (perf_test Specs/Sm80Gate).
inline constexpr double kFa2PerTensorMflop = 872;
// FlashAttention-3's backward loop (flash-attention 0251105a, hdim 128, bf16,
// causal, sm90, its own dispatch: 64 x 128 tiles, two MMA warpgroups; nvcc
// 13.0 with its flags), per million tensor FLOP: 486 instructions a warp an
// iteration when first read (2026-12-05), 496-499 (378-381) read again with
// this reader on the same build. FA3's backward is one loop whose body holds
// its causal mask; loom's masked blocks (the diagonal's, a window's edges)
// run in a loop of their own. The gate of the sm_90a default backward's
// unmasked tensor-core loops (dK and dV, dq) at head_dim 128: the lower figure.
inline constexpr double kFa3BackwardPerTensorMflop = 371;
// The same build's hdim-256 and hdim-192 backward (flash-attention
// 0251105a, hopper/instantiations/flash_bwd_hdim{256,192}_bf16_sm90.cu; 64 x
// 80 and 64 x 96 tiles, two MMA warpgroups; read 2026-12-07): at 256
// causal 539-544 instructions a warp an iteration, 329-332 per tensor
// MFLOP, non-causal 525-543 (320-331), local 664-668 (405-408); at 192
// causal 406-410 (413-417), non-causal 387-395 (394-402), local 535-537
// (544-546). The gates of the sm_90a default backward's unmasked loops
// there: the causal loops' lower figures. Its hdim-96 backward (64 x 128
// tiles; FA3 runs head dims 65 to 96 on it): causal 459-462 (467-470),
// non-causal 427-432 (434-439), local 501-506 (510-515).
inline constexpr double kFa3BackwardHdim256PerTensorMflop = 329;
inline constexpr double kFa3BackwardHdim192PerTensorMflop = 413;
inline constexpr double kFa3BackwardHdim96PerTensorMflop = 467;
// FlashAttention-3's backward loop at `headDim`: the figures above at 96,
// 128, 192 and 256 (0 elsewhere: no anchor read).
double fa3BackwardPerTensorMflop(int headDim);
// One line per way a backward entry's loops miss that gate (an unmasked
// loop of the key-block-outer or dq launch over
// fa3BackwardPerTensorMflop(headDim), local memory in any loop); empty when
// they meet it.
std::vector<std::string> backwardGateMisses(const v1::ResourceUsage& usage, int headDim = 128);
// The share of a loop's exponentials that must sit in the P V window
// (FlashAttention-3's unmasked loop: 13 of 66).
inline constexpr double kMinExpInPvWindowShare = 13.0 / 66.0;

// One line per way a loop of `usage` misses the gate (head_dim `headDim`):
// too many instructions per tensor FLOP, exponentials outside the P V
// window, no ping-pong where `pingPong` is expected, local memory. Empty
// when every loop meets it.
std::vector<std::string> budgetMisses(const v1::ResourceUsage& usage, int headDim, bool pingPong);

// The gate's terms for a compiled forward under `schedule`: two or more
// consumer warpgroups (the wgmma engine, warps > 4) must ping-pong.
bool pingPongExpected(const v1::Schedule& schedule);
// budgetMisses with those terms.
std::vector<std::string> gateMisses(const v1::ResourceUsage& usage, const v1::KernelSpec& spec,
                                    const v1::Schedule& schedule);

// The figures of every function of nvdisasm's `listing` into the entries of
// `resources` it names (entries it adds are appended): what readLoops does
// after disassembling.
void applyListing(const std::string& listing, std::vector<v1::ResourceUsage>& resources);

// A loop's instructions of class `name` (0 for a class it lacks).
int classCount(const v1::SassLoop& loop, const std::string& name);

// One entry's loops in a line, as the tuner's table and the static report
// show them: per loop, instructions per tensor MFLOP ("m": masked), the
// exponentials in the P V window and "pp" for ping-pong; "-" without
// loops, "SASS not read" when nvdisasm was not there.
std::string loopsBrief(const v1::ResourceUsage& usage);

// An entry's memory instructions in a line: "global loads 51 (48 wide,
// 0 16-bit), stores ...".
std::string memoryBrief(const v1::SassMemory& memory);

// A table of the loops of `resources` and their memory instructions, for
// people (loom compile --sass).
std::string formatLoops(const std::vector<v1::ResourceUsage>& resources);

}  // namespace loom::jit::sass
