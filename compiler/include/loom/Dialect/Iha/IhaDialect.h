// The iha dialect: declarations generated from IhaDialect.td / IhaAttrs.td.
#pragma once

#include "mlir/IR/Dialect.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/DialectImplementation.h"

#include "loom/Dialect/Iha/IhaDialect.h.inc"
#include "loom/Dialect/Iha/IhaEnums.h.inc"

#define GET_ATTRDEF_CLASSES
#include "loom/Dialect/Iha/IhaAttrs.h.inc"
