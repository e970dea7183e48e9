//===- IhaAttrs.td - iha enums and attributes ----------------*- tablegen -*-===//
#ifndef LOOM_IHA_ATTRS
#define LOOM_IHA_ATTRS

include "loom/Dialect/Iha/IhaDialect.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def Iha_ElementType : I32EnumAttr<"ElementType", "element type of q, k, v and out", [
    I32EnumAttrCase<"f32", 1>, I32EnumAttrCase<"f16", 2>, I32EnumAttrCase<"bf16", 3>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_MaskMode : I32EnumAttr<"MaskMode", "which virtual rows may attend to which", [
    I32EnumAttrCase<"flat_causal", 1>, I32EnumAttrCase<"token_causal", 2>, I32EnumAttrCase<"none", 3>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_CollapseMode : I32EnumAttr<"CollapseMode", "how pseudo outputs fold back to heads", [
    I32EnumAttrCase<"per_head", 1>, I32EnumAttrCase<"global", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_QkNorm : I32EnumAttr<"QkNorm", "normalisation of the mixed q and k rows", [
    I32EnumAttrCase<"none", 0>, I32EnumAttrCase<"rms", 1>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_RopeDirection : I32EnumAttr<"RopeDirection", "the sense in which RoPE turns each pair", [
    I32EnumAttrCase<"positive", 0>, I32EnumAttrCase<"negative", 1>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_RopeTable : I32EnumAttr<"RopeTable", "RoPE's cosines and sines: exact, or a rounded table", [
    I32EnumAttrCase<"exact", 0>, I32EnumAttrCase<"table_float32", 1>, I32EnumAttrCase<"table_bfloat16", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_WindowAlign : I32EnumAttr<"WindowAlign", "how a window in tokens is counted", [
    I32EnumAttrCase<"virtual_rows", 0, "virtual">, I32EnumAttrCase<"token", 1>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_Role : I32EnumAttr<"Role", "which projection a mixing op works on", [
    I32EnumAttrCase<"query", 1>, I32EnumAttrCase<"key", 2>, I32EnumAttrCase<"value", 3>]> {
  let cppNamespace = "::loom::iha";
  let genSpecializedAttr = 0;
}
def Iha_MixStrategy : I32EnumAttr<"MixStrategy", "where mixing happens", [
    I32EnumAttrCase<"fused", 1>, I32EnumAttrCase<"materialized", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_CollapseStrategy : I32EnumAttr<"CollapseStrategy", "where the collapse happens", [
    I32EnumAttrCase<"epilogue", 1>, I32EnumAttrCase<"separate", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_Engine : I32EnumAttr<"Engine", "which tensor-core instructions the tiles use", [
    I32EnumAttrCase<"mma", 1>, I32EnumAttrCase<"wgmma", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_DqStrategy : I32EnumAttr<"DqStrategy", "how the backward computes dq", [
    I32EnumAttrCase<"separate", 1>, I32EnumAttrCase<"atomic", 2>]> {
  let cppNamespace = "::loom::iha";
}
def Iha_RoleAttr : EnumAttr<Iha_Dialect, Iha_Role, "role">;

// A double-precision float written as a plain float literal.
class Iha_Double : APFloatParameter<"a double"> {
  let parser = [{ [&]() -> ::mlir::FailureOr<::llvm::APFloat> {
    double value;
    if ($_parser.parseFloat(value)) return ::mlir::failure();
    return ::llvm::APFloat(value);
  }() }];
  let printer = [{ $_printer.printFloat($_self) }];
}
def Iha_DoubleParameter : Iha_Double;
// One that defaults to `value` (and is then not printed).
class Iha_DefaultDoubleParameter<string value> : Iha_Double {
  let defaultValue = "::llvm::APFloat(" # value # ")";
}

def Iha_SpecAttr : AttrDef<Iha_Dialect, "Spec"> {
  let mnemonic = "spec";
  let summary = "the IHA function: a KernelSpec";
  let description = [{
    Everything that fixes the math of one IHA computation (docs/IHA.md);
    batch and sequence length stay run-time sizes. The options of public IHA
    code (`qk_norm`, `qk_norm_eps`, `rope_direction`, `window_align`,
    `window_rows`) and `varlen` (packed documents) default away and are then not printed.

    Example:
    ```mlir
    #iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 4, head_dim = 64,
              dtype = f16, mask = flat_causal, window = 2, collapse = per_head,
              rope_theta = 1.0e+04, scale = 1.250000e-01, qk_norm = rms,
              rope_direction = negative, window_align = token>
    ```
  }];
  let parameters = (ins "int64_t":$heads, "int64_t":$kv_heads, "int64_t":$pseudo_heads,
                        "int64_t":$head_dim, "ElementType":$dtype, "MaskMode":$mask,
                        "int64_t":$window, "CollapseMode":$collapse,
                        Iha_DoubleParameter:$rope_theta, Iha_DoubleParameter:$scale,
                        DefaultValuedParameter<"QkNorm", "QkNorm::none">:$qk_norm,
                        Iha_DefaultDoubleParameter<"1e-6">:$qk_norm_eps,
                        DefaultValuedParameter<"RopeDirection", "RopeDirection::positive">:$rope_direction,
                        DefaultValuedParameter<"WindowAlign", "WindowAlign::virtual_rows">:$window_align,
                        DefaultValuedParameter<"int64_t", "0">:$window_rows,
                        DefaultValuedParameter<"bool", "false">:$varlen,
                        DefaultValuedParameter<"RopeTable", "RopeTable::exact">:$rope_table);
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
}

def Iha_ScheduleAttr : AttrDef<Iha_Dialect, "Schedule"> {
  let mnemonic = "schedule";
  let summary = "how the IHA function is computed: a Schedule";
  let description = [{
    Query blocks of `block_m` virtual rows (whole tokens), key blocks of
    `block_n` rows, `warps` warps per CTA, a K/V pipeline `stages` deep, and
    where mixing and collapse happen. `engine = wgmma` (sm_90a) specialises
    warps: a producer warpgroup streams K/V (its registers capped at
    `producer_registers`) to `warps / 4` consumer warpgroups of 64 rows each;
    both default away (mma, 0) and are then not printed. `dq` is how a
    backward kernel computes dq (a query-block-outer kernel of its own, or
    atomic adds from the key-block-outer one); it defaults to `separate`.
    `kv_splits` (decode kernels) splits each query block's key blocks over
    that many CTAs, whose partial rows a combine launch merges; it defaults
    to 1. `stack_heads` (decode kernels) has one CTA run every query head of
    a kv group: the H / G heads' rows stacked in its query block, each head
    the same block_m / (H / G) rows (whole tokens), so that each key block
    is staged and mixed once for the group; it defaults to false.
    `absorb_mixing` (decode kernels over a raw cache) never mixes the cached
    rows: the keys' mix is absorbed into the queries (P rows of R(-j) q a
    query row, combined over the kv heads after the product) and the
    values' into the probabilities; one CTA holds a token of every head. It
    defaults to false. `tensor_mixing` (decode kernels over a raw cache) mixes
    each cached token's rows on the tensor cores in one CTA holding a token
    of every head, two heads a warp; it defaults to false.

    Example:
    ```mlir
    #iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2,
                  mix = fused, collapse = epilogue>
    ```
  }];
  let parameters = (ins "int64_t":$block_m, "int64_t":$block_n, "int64_t":$warps,
                        "int64_t":$stages, "MixStrategy":$mix, "CollapseStrategy":$collapse,
                        DefaultValuedParameter<"Engine", "Engine::mma">:$engine,
                        DefaultValuedParameter<"int64_t", "0">:$producer_registers,
                        DefaultValuedParameter<"DqStrategy", "DqStrategy::separate">:$dq,
                        DefaultValuedParameter<"int64_t", "1">:$kv_splits,
                        DefaultValuedParameter<"bool", "false">:$stack_heads,
                        DefaultValuedParameter<"bool", "false">:$absorb_mixing,
                        DefaultValuedParameter<"bool", "false">:$tensor_mixing);
  let assemblyFormat = "`<` struct(params) `>`";
}

#endif // LOOM_IHA_ATTRS
