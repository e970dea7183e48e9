// Spec + schedule + CUDA target -> CompiledKernel (plan, cubin, resource
// report): the compiler and NVRTC together, for the runtime, the CLI and the
// autotuner.
#pragma once

#include "jit/nvrtc_compiler.h"
#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

Result<v1::CompiledKernel> compileKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                         jit::NvrtcCompiler& compiler, std::shared_ptr<const jit::Artifact>* artifact = nullptr);

}  // namespace loom
