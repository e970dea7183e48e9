#include "loom/Dialect/Iha/IhaDialect.h"

#include "llvm/ADT/TypeSwitch.h"
#include "loom/Dialect/Iha/IhaOps.h"

using namespace mlir;
using namespace loom::iha;

#include "loom/Dialect/Iha/IhaDialect.cpp.inc"
#include "loom/Dialect/Iha/IhaEnums.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "loom/Dialect/Iha/IhaAttrs.cpp.inc"

void IhaDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "loom/Dialect/Iha/IhaAttrs.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "loom/Dialect/Iha/IhaOps.cpp.inc"
      >();
}

LogicalResult SpecAttr::verify(function_ref<InFlightDiagnostic()> emitError, int64_t heads, int64_t kvHeads,
                               int64_t pseudoHeads, int64_t headDim, ElementType, MaskMode mask, int64_t window,
                               CollapseMode, llvm::APFloat ropeThetaValue, llvm::APFloat scaleValue, QkNorm,
                               llvm::APFloat qkNormEpsValue, RopeDirection ropeDirection, WindowAlign windowAlign,
                               int64_t windowRows, bool, RopeTable ropeTable) {
  const double ropeTheta = ropeThetaValue.convertToDouble(), scale = scaleValue.convertToDouble();
  if (heads < 1) return emitError() << "heads (" << heads << ") must be at least 1";
  if (kvHeads < 1 || heads % kvHeads != 0)
    return emitError() << "kv_heads (" << kvHeads << ") must divide heads (" << heads << ")";
  if (pseudoHeads < 1) return emitError() << "pseudo_heads (" << pseudoHeads << ") must be at least 1";
  if (headDim < 1 || headDim % 8 != 0 || headDim > 256)
    return emitError() << "head_dim (" << headDim << ") is unsupported: it must be a multiple of 8 up to 256";
  if (window < 0) return emitError() << "window (" << window << ") must not be negative";
  if (ropeTheta < 0) return emitError() << "rope_theta must not be negative";
  if (ropeTheta > 0 && headDim % 2 != 0)
    return emitError() << "head_dim (" << headDim << ") must be even when rope_theta > 0";
  if (!(scale > 0)) return emitError() << "scale must be positive";
  if (!(qkNormEpsValue.convertToDouble() > 0)) return emitError() << "qk_norm_eps must be positive";
  if (ropeDirection == RopeDirection::negative && ropeTheta == 0)
    return emitError() << "rope_direction negative needs rotary embedding (rope_theta > 0)";
  if (ropeTable != RopeTable::exact && ropeTheta == 0)
    return emitError() << "rope_table_dtype needs rotary embedding (rope_theta > 0)";
  if (windowAlign == WindowAlign::token && window == 0)
    return emitError() << "window_align token needs a window (window > 0 tokens)";
  if (windowRows < 0) return emitError() << "window_rows (" << windowRows << ") must not be negative";
  if (windowRows > 0 && (mask != MaskMode::flat_causal || window != 0))
    return emitError() << "window_rows needs mask flat_causal and window 0";
  return success();
}
