# lit configuration for the iha dialect's FileCheck tests.
import os
import lit.formats

config.name = "loom-iha"
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".mlir", ".test"]
config.excludes = ["lit.cfg.py", "Inputs"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.loom_binary_dir, "compiler", "test")

tools = config.loom_binary_dir + "/bin"
llvm_tools = config.llvm_tools_dir
config.environment["PATH"] = os.pathsep.join([tools, llvm_tools, config.environment.get("PATH", "")])
config.substitutions.append(("%inputs", os.path.join(config.test_source_root, "Inputs")))
