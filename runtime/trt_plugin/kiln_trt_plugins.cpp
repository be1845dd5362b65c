// Kiln's TensorRT plugins: kiln::PagedAttention, the attention layer of a tensorrt engine (docs/tensorrt.md
// states its contract). It rotates q and k, writes this step's keys and values into the layer's KV pools in
// place (each pool is an input whose output aliases it), and runs Kiln's paged attention over the pools. The
// three kernels are Kiln's Triton kernels (runtime/backends/cuda/kernels/), compiled by the build for the plan's
// compute capability and stored in the engine directory; the runtime hands their cubins to this library
// (kiln_register_kernel) before it deserializes the engine, and the node names them by variant key.
//
// Built with g++ alone (kiln_trt_abi.h declares the ABI); the CUDA driver is opened only when a kernel is first
// launched, so the library also loads on a build machine without a GPU, where TensorRT only asks it for shapes,
// types and formats.

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kiln_trt_abi.h"

using namespace nvinfer1;

namespace {

// ------------------------------------------------------------------------------------------ kernels

using CUresult = int;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;

struct Driver {
    CUresult (*moduleLoadData)(CUmodule*, void const*) = nullptr;
    CUresult (*moduleGetFunction)(CUfunction*, CUmodule, char const*) = nullptr;
    CUresult (*funcSetAttribute)(CUfunction, int, int) = nullptr;
    CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
    bool ok = false;
};

constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

std::mutex gLock;
std::string gError;

void fail(std::string const& message) {
    std::lock_guard<std::mutex> hold(gLock);
    gError = message;
    std::fprintf(stderr, "kiln::PagedAttention: %s\n", message.c_str());
}

Driver const& driver() {
    static Driver d = [] {
        Driver out;
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (lib == nullptr) return out;
        out.moduleLoadData = reinterpret_cast<decltype(out.moduleLoadData)>(dlsym(lib, "cuModuleLoadData"));
        out.moduleGetFunction = reinterpret_cast<decltype(out.moduleGetFunction)>(dlsym(lib, "cuModuleGetFunction"));
        out.funcSetAttribute = reinterpret_cast<decltype(out.funcSetAttribute)>(dlsym(lib, "cuFuncSetAttribute"));
        out.launchKernel = reinterpret_cast<decltype(out.launchKernel)>(dlsym(lib, "cuLaunchKernel"));
        out.ok = out.moduleLoadData && out.moduleGetFunction && out.funcSetAttribute && out.launchKernel;
        return out;
    }();
    return d;
}

// One compiled variant of a Triton kernel, as kernels/index.json records it.
struct Kernel {
    std::string key;       // its variant key
    std::string function;
    int numWarps = 4;
    int shared = 0;
    int numParams = 0;
    std::string argTypes;  // one letter per runtime argument: p pointer, i int32, l int64, f float32
    std::vector<char> cubin;
    CUfunction handle = nullptr;
};

std::map<std::string, std::shared_ptr<Kernel>>& kernels() {
    static std::map<std::string, std::shared_ptr<Kernel>> registry;
    return registry;
}

std::shared_ptr<Kernel> findKernel(std::string const& key) {
    std::lock_guard<std::mutex> hold(gLock);
    auto it = kernels().find(key);
    return it == kernels().end() ? nullptr : it->second;
}

// The kernel's function, loaded into the current CUDA context the first time it runs.
bool loaded(Kernel& k) {
    if (k.handle != nullptr) return true;
    Driver const& d = driver();
    if (!d.ok) {
        fail("cannot open the CUDA driver (libcuda.so.1)");
        return false;
    }
    CUmodule module = nullptr;
    CUresult err = d.moduleLoadData(&module, k.cubin.data());
    if (err == 0) err = d.moduleGetFunction(&k.handle, module, k.function.c_str());
    if (err == 0 && k.shared > 48 * 1024) err = d.funcSetAttribute(k.handle, kMaxDynamicSharedBytes, k.shared);
    if (err != 0) {
        k.handle = nullptr;
        fail("loading kernel " + k.function + " failed with CUDA error " + std::to_string(err) +
             " (was the engine compiled for this GPU's compute capability?)");
        return false;
    }
    return true;
}

// A runtime argument: its bits, read as the kernel's signature says.
struct Arg {
    uint64_t bits;
    static Arg ptr(void const* p) { return {reinterpret_cast<uint64_t>(p)}; }
    static Arg i(int64_t v) { return {static_cast<uint64_t>(v)}; }
    static Arg f(float v) {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        return {u};
    }
};

// Tests only (kiln_set_launch_hook): every launch goes to the hook instead of the driver, with its arguments'
// bits, so the plugin's host logic runs, and is checked, where there is no GPU.
using LaunchHook = int (*)(char const* key, unsigned gx, unsigned gy, unsigned gz, uint64_t const* args, int count);
LaunchHook gHook = nullptr;

bool launch(Kernel& k, unsigned gx, unsigned gy, unsigned gz, std::vector<Arg> const& args, cudaStream_t stream) {
    if (gx == 0 || gy == 0 || gz == 0) return true;
    if (gHook != nullptr) {
        std::vector<uint64_t> bits;
        for (Arg const& a : args) bits.push_back(a.bits);
        return gHook(k.key.c_str(), gx, gy, gz, bits.data(), static_cast<int>(bits.size())) == 0;
    }
    if (!loaded(k)) return false;
    if (args.size() != k.argTypes.size() || k.numParams < static_cast<int>(args.size())) {
        fail(k.function + ": " + std::to_string(args.size()) + " arguments for a kernel of " + k.argTypes);
        return false;
    }
    // Each argument in its own slot of the width the kernel reads; Triton's trailing scratch pointers are null
    // (the build refuses variants that need global scratch).
    std::vector<uint64_t> slots(k.numParams, 0);
    std::vector<void*> params(k.numParams);
    for (int n = 0; n < k.numParams; ++n) {
        if (n < static_cast<int>(args.size())) {
            char t = k.argTypes[n];
            if (t == 'i') {
                int32_t v = static_cast<int32_t>(static_cast<int64_t>(args[n].bits));
                std::memcpy(&slots[n], &v, 4);
            } else if (t == 'f') {
                uint32_t v = static_cast<uint32_t>(args[n].bits);
                std::memcpy(&slots[n], &v, 4);
            } else {
                slots[n] = args[n].bits;
            }
        }
        params[n] = &slots[n];
    }
    CUresult err = driver().launchKernel(k.handle, gx, gy, gz, 32 * k.numWarps, 1, 1, k.shared,
                                         reinterpret_cast<CUstream>(stream), params.data(), nullptr);
    if (err != 0) {
        fail("launching " + k.function + " failed with CUDA error " + std::to_string(err));
        return false;
    }
    return true;
}

// ------------------------------------------------------------------------------------------ fields

// The node's attributes, which the engine keeps as the plugin's serialized fields.
struct Config {
    float scale = 1.0f;
    int64_t window = 0;
    float kvScale = 1.0f;
    int64_t queriesPerTile = 1;  // query rows of one attention program: its BLOCK_M over the GQA group
    std::string ropeKernel, writeKernel, attentionKernel;
};

char const* const kFieldNames[] = {"scale", "window", "kv_scale", "queries_per_tile", "rope_kernel",
                                   "kv_write_kernel", "attention_kernel"};

double number(PluginField const& f) {
    switch (f.type) {
        case PluginFieldType::kFLOAT32: return *static_cast<float const*>(f.data);
        case PluginFieldType::kFLOAT64: return *static_cast<double const*>(f.data);
        case PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
        case PluginFieldType::kINT64: return static_cast<double>(*static_cast<int64_t const*>(f.data));
        default: return 0.0;
    }
}

std::string text(PluginField const& f) {
    char const* s = static_cast<char const*>(f.data);
    size_t n = f.length > 0 ? static_cast<size_t>(f.length) : std::strlen(s);
    while (n > 0 && s[n - 1] == '\0') --n;
    return std::string(s, n);
}

Config readFields(PluginFieldCollection const* fc) {
    Config c;
    for (int32_t n = 0; fc != nullptr && n < fc->nbFields; ++n) {
        PluginField const& f = fc->fields[n];
        if (f.name == nullptr || f.data == nullptr) continue;
        std::string name = f.name;
        if (name == "scale") c.scale = static_cast<float>(number(f));
        else if (name == "window") c.window = static_cast<int64_t>(number(f));
        else if (name == "kv_scale") c.kvScale = static_cast<float>(number(f));
        else if (name == "queries_per_tile") c.queriesPerTile = static_cast<int64_t>(number(f));
        else if (name == "rope_kernel") c.ropeKernel = text(f);
        else if (name == "kv_write_kernel") c.writeKernel = text(f);
        else if (name == "attention_kernel") c.attentionKernel = text(f);
    }
    return c;
}

// Inputs and outputs of the node, in the contract's order.
enum Input { kQ, kK, kV, kPositions, kRopeTable, kKCache, kVCache, kSlots, kBlockTables, kContextLens,
             kQueryStarts, kKvScale, kNumInputs };
enum Output { kOut, kKCacheOut, kVCacheOut, kNumOutputs };

bool isFloat(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

size_t elementBytes(DataType t) {
    switch (t) {
        case DataType::kFLOAT: case DataType::kINT32: return 4;
        case DataType::kHALF: case DataType::kBF16: return 2;
        case DataType::kINT64: return 8;
        default: return 1;
    }
}

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// ------------------------------------------------------------------------------------------ the plugin

class PagedAttention final : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2,
                             public IPluginV3OneRuntime {
public:
    explicit PagedAttention(Config config) : mConfig(std::move(config)) {}

    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    IPluginV3* clone() noexcept override { return new PagedAttention(mConfig); }

    char const* getPluginName() const noexcept override { return "PagedAttention"; }
    char const* getPluginVersion() const noexcept override { return "1"; }
    char const* getPluginNamespace() const noexcept override { return "kiln"; }

    int32_t getNbOutputs() const noexcept override { return kNumOutputs; }

    int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t nbOutputs) noexcept override {
        return nbInputs == kNumInputs && nbOutputs == kNumOutputs ? 0 : -1;
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (nbInputs != kNumInputs || nbOutputs != kNumOutputs) return -1;
        outputTypes[kOut] = inputTypes[kQ];
        outputTypes[kKCacheOut] = inputTypes[kKCache];
        outputTypes[kVCacheOut] = inputTypes[kVCache];
        return 0;
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
                            DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept override {
        if (nbInputs != kNumInputs || nbOutputs != kNumOutputs) return -1;
        outputs[kOut] = inputs[kQ];
        outputs[kKCacheOut] = inputs[kKCache];
        outputs[kVCacheOut] = inputs[kVCache];
        return 0;
    }

    // The pools are written in place: each pool's output is its input's buffer.
    int32_t getAliasedInput(int32_t outputIndex) noexcept override {
        return outputIndex == kKCacheOut ? kKCache : outputIndex == kVCacheOut ? kVCache : -1;
    }

    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (nbInputs != kNumInputs || nbOutputs != kNumOutputs || pos < 0 || pos >= nbInputs + nbOutputs) return false;
        PluginTensorDesc const& d = io[pos].desc;
        if (d.format != TensorFormat::kLINEAR) return false;
        DataType act = io[kQ].desc.type, cache = io[kKCache].desc.type;
        switch (pos) {
            case kQ: return isFloat(d.type);
            case kK: case kV: return d.type == act;
            case kPositions: case kSlots: return d.type == DataType::kINT64;
            case kRopeTable: case kKvScale: return d.type == DataType::kFLOAT;
            // an fp8 cache arrives as int8 pools of e4m3 bit patterns (the ONNX has no float8 scatter)
            case kKCache: return isFloat(d.type) || d.type == DataType::kFP8 || d.type == DataType::kINT8;
            case kVCache: return d.type == cache;
            case kBlockTables: case kContextLens: case kQueryStarts: return d.type == DataType::kINT32;
            default: break;
        }
        int32_t out = pos - nbInputs;
        return out == kOut ? d.type == act : d.type == cache;
    }

    // Scratch for the rotated q and k of the longest step.
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t) const noexcept override {
        if (nbInputs != kNumInputs) return 0;
        size_t bytes = elementBytes(in[kQ].desc.type);
        int64_t tokens = in[kQ].max.d[0];
        return aligned(tokens * in[kQ].max.d[1] * bytes) + aligned(tokens * in[kK].max.d[1] * bytes);
    }

    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override {
        return 0;
    }

    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }

    PluginFieldCollection const* getFieldsToSerialize() noexcept override {
        mWindow = static_cast<int32_t>(mConfig.window);
        mQueriesPerTile = static_cast<int32_t>(mConfig.queriesPerTile);
        mFields = {
            {kFieldNames[0], &mConfig.scale, PluginFieldType::kFLOAT32, 1},
            {kFieldNames[1], &mWindow, PluginFieldType::kINT32, 1},
            {kFieldNames[2], &mConfig.kvScale, PluginFieldType::kFLOAT32, 1},
            {kFieldNames[3], &mQueriesPerTile, PluginFieldType::kINT32, 1},
            {kFieldNames[4], mConfig.ropeKernel.c_str(), PluginFieldType::kCHAR,
             static_cast<int32_t>(mConfig.ropeKernel.size() + 1)},
            {kFieldNames[5], mConfig.writeKernel.c_str(), PluginFieldType::kCHAR,
             static_cast<int32_t>(mConfig.writeKernel.size() + 1)},
            {kFieldNames[6], mConfig.attentionKernel.c_str(), PluginFieldType::kCHAR,
             static_cast<int32_t>(mConfig.attentionKernel.size() + 1)},
        };
        mCollection = {static_cast<int32_t>(mFields.size()), mFields.data()};
        return &mCollection;
    }

    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const*, void const* const* inputs,
                    void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
        int64_t tokens = inDesc[kQ].dims.d[0];
        if (tokens == 0) return 0;
        if (!resolve()) return -1;
        for (int n = 0; n < kNumInputs; ++n) {  // the kernels were compiled for 16-byte aligned pointers
            if (reinterpret_cast<uintptr_t>(inputs[n]) % 16 != 0) {
                fail("input " + std::to_string(n) + " is not 16-byte aligned");
                return -1;
            }
        }
        int64_t qWidth = inDesc[kQ].dims.d[1], kWidth = inDesc[kK].dims.d[1];
        int64_t kvHeads = inDesc[kKCache].dims.d[2], headDim = inDesc[kKCache].dims.d[3];
        int64_t heads = qWidth / headDim;
        int64_t seqs = inDesc[kContextLens].dims.d[0];
        int64_t tableWidth = inDesc[kBlockTables].dims.d[1];
        size_t bytes = elementBytes(inDesc[kQ].type);
        char* scratch = static_cast<char*>(workspace);
        void* qRotated = scratch;
        void* kRotated = scratch + aligned(tokens * qWidth * bytes);
        void* kCache = outputs[kKCacheOut];  // the same buffers as inputs[kKCache], inputs[kVCache]
        void* vCache = outputs[kVCacheOut];

        // 1. rotary embedding of q and k into the scratch
        bool ok = launch(*mRope, tokens, heads + kvHeads, 1,
                         {Arg::ptr(inputs[kQ]), Arg::ptr(inputs[kK]), Arg::ptr(qRotated), Arg::ptr(kRotated),
                          Arg::ptr(inputs[kPositions]), Arg::ptr(inputs[kRopeTable]), Arg::i(qWidth), Arg::i(kWidth),
                          Arg::i(qWidth), Arg::i(kWidth)},
                         stream);
        // 2. this step's keys and values into their slots of the pools
        ok = ok && launch(*mWrite, tokens, kvHeads, 1,
                          {Arg::ptr(kRotated), Arg::ptr(inputs[kV]), Arg::ptr(kCache), Arg::ptr(vCache),
                           Arg::ptr(inputs[kSlots]), Arg::i(kWidth), Arg::i(kWidth), Arg::i(kvHeads),
                           Arg::f(mConfig.kvScale)},
                          stream);
        // 3. attention through the block tables. Every sequence has a token in the step, so no query is longer
        // than tokens - seqs + 1 (1 on a decode step).
        int64_t longest = tokens - seqs + 1;
        int64_t tiles = (longest + mConfig.queriesPerTile - 1) / mConfig.queriesPerTile;
        ok = ok && launch(*mAttention, seqs, kvHeads, tiles,
                          {Arg::ptr(outputs[kOut]), Arg::ptr(qRotated), Arg::ptr(kCache), Arg::ptr(vCache),
                           Arg::ptr(inputs[kBlockTables]), Arg::ptr(inputs[kContextLens]),
                           Arg::ptr(inputs[kQueryStarts]), Arg::i(qWidth), Arg::i(qWidth), Arg::i(tableWidth),
                           Arg::i(kvHeads), Arg::f(mConfig.scale), Arg::f(mConfig.kvScale), Arg::i(mConfig.window)},
                          stream);
        return ok ? 0 : -1;
    }

private:
    bool resolve() {
        if (mRope && mWrite && mAttention) return true;
        mRope = findKernel(mConfig.ropeKernel);
        mWrite = findKernel(mConfig.writeKernel);
        mAttention = findKernel(mConfig.attentionKernel);
        if (!mRope || !mWrite || !mAttention) {
            fail("kernels " + mConfig.ropeKernel + ", " + mConfig.writeKernel + ", " + mConfig.attentionKernel +
                 " are not all registered: load the engine with Kiln's tensorrt backend, which registers the "
                 "engine's kernels/ before deserializing it");
            return false;
        }
        return true;
    }

    Config mConfig;
    std::shared_ptr<Kernel> mRope, mWrite, mAttention;
    int32_t mWindow = 0, mQueriesPerTile = 1;
    std::vector<PluginField> mFields;
    PluginFieldCollection mCollection{};
};

class PagedAttentionCreator final : public IPluginCreatorV3One {
public:
    PagedAttentionCreator() {
        for (char const* name : kFieldNames) mFields.push_back({name, nullptr, PluginFieldType::kUNKNOWN, 0});
        mFields[0].type = PluginFieldType::kFLOAT32;
        mFields[1].type = PluginFieldType::kINT32;
        mFields[2].type = PluginFieldType::kFLOAT32;
        mFields[3].type = PluginFieldType::kINT32;
        for (size_t n = 4; n < mFields.size(); ++n) mFields[n].type = PluginFieldType::kCHAR;
        mCollection = {static_cast<int32_t>(mFields.size()), mFields.data()};
    }

    IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
        return new PagedAttention(readFields(fc));
    }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }
    char const* getPluginName() const noexcept override { return "PagedAttention"; }
    char const* getPluginVersion() const noexcept override { return "1"; }
    char const* getPluginNamespace() const noexcept override { return "kiln"; }

private:
    std::vector<PluginField> mFields;
    PluginFieldCollection mCollection{};
};

}  // namespace

extern "C" {

// TensorRT's loadLibrary asks for this too; the plugins report through stderr, so the finder is not kept.
__attribute__((visibility("default"))) void setLoggerFinder(void*) {}

// TensorRT's entry point for IPluginRegistry::loadLibrary.
__attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static PagedAttentionCreator pagedAttention;
    static IPluginCreatorInterface* const creators[] = {&pagedAttention};
    nbCreators = 1;
    return creators;
}

// Hands one compiled kernel to the plugins (a copy is kept). arg_types: a letter per runtime argument.
__attribute__((visibility("default"))) int kiln_register_kernel(char const* key, char const* function,
                                                                int num_warps, int shared, int num_params,
                                                                char const* arg_types, void const* cubin,
                                                                size_t size) {
    auto k = std::make_shared<Kernel>();
    k->key = key;
    k->function = function;
    k->numWarps = num_warps;
    k->shared = shared;
    k->numParams = num_params;
    k->argTypes = arg_types;
    k->cubin.assign(static_cast<char const*>(cubin), static_cast<char const*>(cubin) + size);
    std::lock_guard<std::mutex> hold(gLock);
    kernels()[key] = k;
    return static_cast<int>(kernels().size());
}

// Tests only: route launches to `hook` (nullptr: the CUDA driver again).
__attribute__((visibility("default"))) void kiln_set_launch_hook(LaunchHook hook) { gHook = hook; }

// Tests only: one PagedAttention enqueue as TensorRT makes it, from the node's attributes and each input's dims
// (kMaxDims + 1 values: the count, then the extents), types, and pointers. 0 on success.
__attribute__((visibility("default"))) int kiln_test_paged_attention(
    char const* ropeKernel, char const* writeKernel, char const* attentionKernel, float scale, int window,
    float kvScale, int queriesPerTile, int64_t const* dims, int32_t const* types, void const* const* inputs,
    void* const* outputs, void* workspace) {
    Config c;
    c.ropeKernel = ropeKernel;
    c.writeKernel = writeKernel;
    c.attentionKernel = attentionKernel;
    c.scale = scale;
    c.window = window;
    c.kvScale = kvScale;
    c.queriesPerTile = queriesPerTile;
    PagedAttention plugin(c);
    PluginTensorDesc in[kNumInputs] = {};
    for (int n = 0; n < kNumInputs; ++n) {
        in[n].dims.nbDims = static_cast<int32_t>(dims[n * (kMaxDims + 1)]);
        for (int d = 0; d < kMaxDims; ++d) in[n].dims.d[d] = dims[n * (kMaxDims + 1) + 1 + d];
        in[n].type = static_cast<DataType>(types[n]);
        in[n].format = TensorFormat::kLINEAR;
    }
    return plugin.enqueue(in, nullptr, inputs, outputs, workspace, nullptr);
}

// The last error a plugin reported ("" if none).
__attribute__((visibility("default"))) char const* kiln_last_error() {
    std::lock_guard<std::mutex> hold(gLock);
    return gError.c_str();
}

}  // extern "C"
