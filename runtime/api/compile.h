// Spec + schedule + CUDA target -> CompiledKernel (plan, cubin, resource
// report): the compiler and NVRTC together, for the runtime, the CLI and the
// autotuner.
#pragma once

#include "jit/nvrtc_compiler.h"
#include "loom/compiler.h"
#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

// Stamps `kernel` with what identifies its compiler for `arch`: the NVRTC
// version, the binary kind (cubin, or PTX where NVRTC cannot assemble the
// arch) and the options. They are part of its content address in the cache
// (cache::artifactKey), which knows no compiler.
void setCompilerIdentity(v1::CompiledKernel& kernel, const std::string& arch);

// `direction` backward: the backward plan (docs/compiler.md, "The backward");
// decode: a step over a paged cache, a mixed one with `mixedCache`.
Result<v1::CompiledKernel> compileKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                         jit::NvrtcCompiler& compiler, std::shared_ptr<const jit::Artifact>* artifact = nullptr,
                                         Direction direction = Direction::forward, bool mixedCache = false);

}  // namespace loom
