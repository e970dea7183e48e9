//===- IhaDialect.td - the iha dialect ---------------------*- tablegen -*-===//
//
// The `iha` dialect describes one Interleaved Head Attention computation
// (docs/IHA.md) and, as passes refine it, its schedule: launches, query
// blocks, key-block loops and where mixing and collapse happen.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_IHA_DIALECT
#define LOOM_IHA_DIALECT

include "mlir/IR/OpBase.td"

def Iha_Dialect : Dialect {
  let name = "iha";
  let cppNamespace = "::loom::iha";
  let summary = "Interleaved Head Attention, from spec to tiled kernel program";
  let description = [{
    A program in this dialect starts as an `iha.kernel` carrying a
    `#iha.spec` (the function) and grows, pass by pass, into launches of
    tiled kernels (`iha.launch`) whose ops map one to one onto the tile API
    (tile/) that the EmitC lowering calls.
  }];
  let useDefaultAttributePrinterParser = 1;
}

class Iha_Op<string mnemonic, list<Trait> traits = []> : Op<Iha_Dialect, mnemonic, traits>;

#endif // LOOM_IHA_DIALECT
