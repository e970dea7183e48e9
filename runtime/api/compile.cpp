#include "api/compile.h"

#include "loom/compiler.h"

namespace loom {

void setCompilerIdentity(v1::CompiledKernel& kernel, const std::string& arch) {
  kernel.set_toolchain(jit::nvrtcVersion() + (jit::nvrtcKnowsArch(arch) ? " cubin" : " ptx"));
  kernel.set_compile_options(jit::kNvrtcOptions);
}

Result<v1::CompiledKernel> compileKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                         jit::NvrtcCompiler& compiler, std::shared_ptr<const jit::Artifact>* artifact,
                                         Direction direction, bool mixedCache) {
  if (target.kind() != v1::Target::cuda) return makeError("compileKernel needs a CUDA target");
  GenerateOptions options;
  options.direction = direction;
  options.mixedCache = mixedCache;
  auto plan = generateKernel(spec, schedule, target, options);
  if (!plan) return plan.error();
  auto compiled = compiler.compile(plan->source, target.arch());
  if (!compiled) return compiled.error();
  const jit::Artifact& a = **compiled;
  v1::CompiledKernel kernel = toCompiledKernel(*plan);
  kernel.set_binary(a.binary);
  setCompilerIdentity(kernel, target.arch());
  kernel.set_compile_seconds(a.compileSeconds);
  kernel.set_compile_log(a.log);
  kernel.set_ptx(a.ptx);
  for (const auto& r : a.resources) *kernel.add_resources() = r;
  if (artifact) *artifact = *compiled;
  return kernel;
}

}  // namespace loom
