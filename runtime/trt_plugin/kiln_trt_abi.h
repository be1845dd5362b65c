// The part of TensorRT's plugin ABI that Kiln's plugins implement: the IPluginV3 family (core, build with
// aliased outputs, runtime) and its creator, with the structs they exchange. TensorRT reads a plugin through
// these classes' virtual tables, so what matters here is each class's virtual functions in order and the
// layout of the structs; both follow TensorRT 10's public API (NvInferRuntime.h, NvInferPluginBase.h), which
// TensorRT for RTX shares. TensorRT's headers are not on PyPI; this file lets the plugin build with g++ alone.
//
// Each interface reports its kind and version through getInterfaceInfo(); a plugin must not override it, so
// that each of its capability bases answers for itself.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nvinfer1 {

enum class DataType : int32_t { kFLOAT = 0, kHALF = 1, kINT8 = 2, kINT32 = 3, kBOOL = 4, kUINT8 = 5, kFP8 = 6,
                                kBF16 = 7, kINT64 = 8 };
enum class TensorFormat : int32_t { kLINEAR = 0 };
enum class APILanguage : int32_t { kCPP = 0, kPYTHON = 1 };
enum class PluginFieldType : int32_t { kFLOAT16 = 0, kFLOAT32 = 1, kFLOAT64 = 2, kINT8 = 3, kINT16 = 4, kINT32 = 5,
                                       kCHAR = 6, kDIMS = 7, kUNKNOWN = 8, kBF16 = 9, kINT64 = 10 };
enum class TensorRTPhase : int32_t { kBUILD = 0, kRUNTIME = 1 };
enum class PluginCapabilityType : int32_t { kCORE = 0, kBUILD = 1, kRUNTIME = 2 };

struct InterfaceInfo {
    char const* kind;
    int32_t major;
    int32_t minor;
};

constexpr int32_t kMaxDims = 8;

struct Dims {  // TensorRT's Dims64
    int32_t nbDims;
    int64_t d[kMaxDims];
};

class IDimensionExpr;  // opaque here: output shapes are copied from input shapes
class IExprBuilder;
class IPluginResourceContext;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct DimsExprs {
    int32_t nbDims;
    IDimensionExpr const* d[kMaxDims];
};

struct PluginTensorDesc {
    Dims dims;
    DataType type;
    TensorFormat format;
    float scale;
};

struct DynamicPluginTensorDesc {
    PluginTensorDesc desc;
    Dims min;
    Dims max;
    Dims opt;
};

struct PluginField {
    char const* name;
    void const* data;
    PluginFieldType type;
    int32_t length;
};

struct PluginFieldCollection {
    int32_t nbFields;
    PluginField const* fields;
};

class IVersionedInterface {
public:
    virtual APILanguage getAPILanguage() const noexcept { return APILanguage::kCPP; }
    virtual InterfaceInfo getInterfaceInfo() const noexcept = 0;
    virtual ~IVersionedInterface() noexcept = default;
};

class IPluginCapability : public IVersionedInterface {};

class IPluginCreatorInterface : public IVersionedInterface {};

class IPluginV3 : public IVersionedInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"PLUGIN", 1, 0}; }
    virtual IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept = 0;
    virtual IPluginV3* clone() noexcept = 0;
};

class IPluginV3OneCore : public IPluginCapability {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"PLUGIN_V3ONE_CORE", 1, 0}; }
    virtual char const* getPluginName() const noexcept = 0;
    virtual char const* getPluginVersion() const noexcept = 0;
    virtual char const* getPluginNamespace() const noexcept = 0;
};

class IPluginV3OneBuildV2 : public IPluginCapability {  // version 2 of the build capability: aliased outputs
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"PLUGIN_V3ONE_BUILD", 2, 0}; }
    virtual int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                    DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept = 0;
    virtual int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                       int32_t nbInputs) const noexcept = 0;
    virtual int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                                    int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                    IExprBuilder& exprBuilder) noexcept = 0;
    virtual bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                           int32_t nbOutputs) noexcept = 0;
    virtual int32_t getNbOutputs() const noexcept = 0;
    virtual size_t getWorkspaceSize(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*,
                                    int32_t) const noexcept { return 0; }
    virtual int32_t getValidTactics(int32_t*, int32_t) noexcept { return 0; }
    virtual int32_t getNbTactics() noexcept { return 0; }
    virtual char const* getTimingCacheID() noexcept { return nullptr; }
    virtual int32_t getFormatCombinationLimit() noexcept { return 100; }
    virtual char const* getMetadataString() noexcept { return nullptr; }
    virtual int32_t getAliasedInput(int32_t) noexcept { return -1; }
};

class IPluginV3OneRuntime : public IPluginCapability {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"PLUGIN_V3ONE_RUNTIME", 1, 0}; }
    virtual int32_t setTactic(int32_t) noexcept { return 0; }
    virtual int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                  int32_t nbOutputs) noexcept = 0;
    virtual int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                            void const* const* inputs, void* const* outputs, void* workspace,
                            cudaStream_t stream) noexcept = 0;
    virtual IPluginV3* attachToContext(IPluginResourceContext* context) noexcept = 0;
    virtual PluginFieldCollection const* getFieldsToSerialize() noexcept = 0;
};

class IPluginCreatorV3One : public IPluginCreatorInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"PLUGIN CREATOR_V3ONE", 1, 0}; }
    virtual IPluginV3* createPlugin(char const* name, PluginFieldCollection const* fc,
                                    TensorRTPhase phase) noexcept = 0;
    virtual PluginFieldCollection const* getFieldNames() noexcept = 0;
    virtual char const* getPluginName() const noexcept = 0;
    virtual char const* getPluginVersion() const noexcept = 0;
    virtual char const* getPluginNamespace() const noexcept = 0;
};

}  // namespace nvinfer1
