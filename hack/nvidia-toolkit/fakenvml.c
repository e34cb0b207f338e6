/*
 * A native libnvidia-ml.so.1 for a mock node, for tools that dlopen NVML themselves
 * (NVIDIA's nvidia-ctk, built by hack/local-cluster/build.sh nvidia-toolkit). The driver's
 * own mock NVML is driver/devices/mock/fakenvml.py, under nvidia-ml-py; this library
 * answers the same questions from a snapshot of that model's GPUs
 * (driver/devices/mock/nativenvml.py writes it): the file named by DRA_MOCK_NVML_STATE, or
 * `nvml-state` beside this library.
 *
 * Declarations come from NVML's own nvml.h as go-nvml ships it, so every signature and
 * struct layout is the real one (go-nvml wraps the handle pointer in a one-member struct,
 * nvmlDevice_t.handle, which the x86-64 and arm64 ABIs pass exactly as the pointer). Only what nvidia-ctk's `cdi generate --mode nvml` calls is
 * exported; a function it would call that is missing shows as "symbol lookup error",
 * never as a silent success. Return codes follow the NVML reference: UNINITIALIZED before
 * nvmlInit, NOT_SUPPORTED for MIG queries on a GPU without MIG, INSUFFICIENT_SIZE for a
 * short buffer, NOT_FOUND for an unknown UUID or an empty MIG slot.
 *
 * State file lines (space separated; the name last, it may hold spaces):
 *   driver <version>
 *   cuda <version as NVML encodes it, 12040>
 *   gpu <index> <minor> <uuid> <busId sysfs form> <pciDeviceId> <migCapable 0|1> <migMode 0|1> <memory bytes> <name>
 *   mig <gpu index> <slot> <gi> <ci> <uuid> <memory bytes> <SMs> <copy engines> <decoders>
 *       <encoders> <slices> <name>
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nvml.h"

#define MAX_GPUS 64
#define MAX_MIGS 7
#define NAME_LEN 96

struct nvmlDevice_st {
    int is_mig;
    unsigned int index, minor, pci_device, mig_capable, mig_mode;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE], bus_id[32], name[NAME_LEN];
    unsigned int gi, ci;
    unsigned long long memory;
    unsigned int sms, copy_engines, decoders, encoders, slices; /* MIG devices */
    struct nvmlDevice_st *parent;
    struct nvmlDevice_st *migs[MAX_MIGS];
};

static struct nvmlDevice_st gpus[MAX_GPUS];
static struct nvmlDevice_st migs[MAX_GPUS * MAX_MIGS];
static unsigned int gpu_count, mig_count, init_count;
static int cuda_version;
static char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];

static const char *state_path(char *buf, size_t len) {
    const char *env = getenv("DRA_MOCK_NVML_STATE");
    if (env && *env) return env;
    Dl_info info;
    if (!dladdr((void *)state_path, &info) || !info.dli_fname) return NULL;
    snprintf(buf, len, "%s", info.dli_fname);
    char *slash = strrchr(buf, '/');
    if (!slash) return NULL;
    snprintf(slash + 1, len - (size_t)(slash + 1 - buf), "nvml-state");
    return buf;
}

static void rest_of_line(const char *line, int fields, char *out, size_t len) {
    const char *p = line;
    for (int i = 0; i < fields && p; i++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    snprintf(out, len, "%s", p ? p : "");
    out[strcspn(out, "\n")] = 0;
}

static nvmlReturn_t load(void) {
    char buf[4096], line[512];
    const char *path = state_path(buf, sizeof buf);
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return NVML_ERROR_DRIVER_NOT_LOADED; /* no kernel module: what NVML says */
    gpu_count = mig_count = 0;
    while (fgets(line, sizeof line, f)) {
        struct nvmlDevice_st d = {0};
        unsigned int gpu, slot;
        if (sscanf(line, "driver %79s", driver_version) == 1) continue;
        if (sscanf(line, "cuda %d", &cuda_version) == 1) continue;
        if (gpu_count < MAX_GPUS &&
            sscanf(line, "gpu %u %u %95s %31s %x %u %u %llu", &d.index, &d.minor, d.uuid, d.bus_id,
                   &d.pci_device, &d.mig_capable, &d.mig_mode, &d.memory) == 8) {
            rest_of_line(line, 9, d.name, sizeof d.name);
            gpus[gpu_count++] = d;
        } else if (mig_count < MAX_GPUS * MAX_MIGS &&
                   sscanf(line, "mig %u %u %u %u %95s %llu %u %u %u %u %u", &gpu, &slot, &d.gi,
                          &d.ci, d.uuid, &d.memory, &d.sms, &d.copy_engines, &d.decoders,
                          &d.encoders, &d.slices) == 11 &&
                   gpu < gpu_count && slot < MAX_MIGS) {
            rest_of_line(line, 12, d.name, sizeof d.name);
            d.is_mig = 1;
            d.index = slot;
            d.parent = &gpus[gpu];
            migs[mig_count] = d;
            gpus[gpu].migs[slot] = &migs[mig_count++];
        }
    }
    fclose(f);
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t device) {
    const struct nvmlDevice_st *d = device.handle;
    if (!init_count || !d) return 0;
    return (d >= gpus && d < gpus + gpu_count) || (d >= migs && d < migs + mig_count);
}

#define CHECK_INIT() do { if (!init_count) return NVML_ERROR_UNINITIALIZED; } while (0)
#define CHECK_DEVICE(d) do { CHECK_INIT(); if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT; } while (0)
#define HANDLE(p) ((nvmlDevice_t){.handle = (p)})

static nvmlReturn_t put_string(char *out, unsigned int length, const char *value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, value);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (init_count) { init_count++; return NVML_SUCCESS; }
    nvmlReturn_t r = load();
    if (r == NVML_SUCCESS) init_count = 1;
    return r;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    CHECK_INIT();
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    CHECK_INIT();
    return put_string(version, length, driver_version);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    CHECK_INIT();
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    CHECK_INIT();
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    CHECK_INIT();
    if (!device || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = HANDLE(&gpus[index]);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    CHECK_INIT();
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++)
        if (!strcmp(gpus[i].uuid, uuid)) { *device = HANDLE(&gpus[i]); return NVML_SUCCESS; }
    for (unsigned int i = 0; i < mig_count; i++)
        if (!strcmp(migs[i].uuid, uuid)) { *device = HANDLE(&migs[i]); return NVML_SUCCESS; }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK_DEVICE(device);
    return put_string(uuid, length, device.handle->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK_DEVICE(device);
    return put_string(name, length, device.handle->name);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    CHECK_DEVICE(device);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device.handle->index; /* a MIG device: its slot on the parent */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    CHECK_DEVICE(device);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    if (device.handle->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *minor = device.handle->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    CHECK_DEVICE(device);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const struct nvmlDevice_st *gpu = device.handle->is_mig ? device.handle->parent : device.handle;
    unsigned int domain, bus, dev, fn;
    if (sscanf(gpu->bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4)
        return NVML_ERROR_UNKNOWN;
    memset(pci, 0, sizeof *pci);
    /* NVML: an 8-digit upper-case domain in busId, the 4-digit legacy form beside it. */
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev, fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = (gpu->pci_device << 16) | 0x10DE;
    pci->pciSubSystemId = (0x1000u << 16) | 0x10DE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    CHECK_DEVICE(device);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    if (device.handle->is_mig || !device.handle->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = device.handle->mig_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    CHECK_DEVICE(device);
    if (!isMigDevice) return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = (unsigned int)device.handle->is_mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    CHECK_DEVICE(device);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (device.handle->is_mig || !device.handle->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *count = MAX_MIGS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *migDevice) {
    CHECK_DEVICE(device);
    if (device.handle->is_mig || !device.handle->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (!migDevice || index >= MAX_MIGS) return NVML_ERROR_INVALID_ARGUMENT;
    /* MIG off: no MIG device at any index (as fakenvml.py answers) */
    if (!device.handle->mig_mode || !device.handle->migs[index]) return NVML_ERROR_NOT_FOUND;
    *migDevice = HANDLE(device.handle->migs[index]);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    CHECK_DEVICE(migDevice);
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    if (!migDevice.handle->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *device = HANDLE(migDevice.handle->parent);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    CHECK_DEVICE(device);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device.handle->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *id = device.handle->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    CHECK_DEVICE(device);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device.handle->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *id = device.handle->ci;
    return NVML_SUCCESS;
}

/* The snapshot carries no load: all of a device's memory is free (a mock GPU at rest). */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    CHECK_DEVICE(device);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = memory->free = device.handle->memory;
    memory->used = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    CHECK_DEVICE(device);
    if (!attributes) return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML: "currently only supports MIG device handles" */
    if (!device.handle->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    const struct nvmlDevice_st *m = device.handle;
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = m->sms;
    attributes->sharedCopyEngineCount = m->copy_engines;
    attributes->sharedDecoderCount = m->decoders;
    attributes->sharedEncoderCount = m->encoders;
    attributes->gpuInstanceSliceCount = m->slices;
    attributes->computeInstanceSliceCount = m->slices;
    attributes->memorySizeMB = m->memory >> 20;
    return NVML_SUCCESS;
}
