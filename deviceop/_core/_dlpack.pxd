# dlpack.h's structs, as the DLPack specification lays them out (version 1)
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

# the C exchange API a producer type publishes as ``__dlpack_c_exchange_api__`` (a capsule named
# "dlpack_exchange_api"); only the members deviceop calls are typed
ctypedef int (*DLTensorFromPyObjectNoSync)(void* py_object, DLTensor* out) noexcept

cdef struct DLPackExchangeAPIHeader:
    DLPackVersion version
    DLPackExchangeAPIHeader* prev_api

cdef struct DLPackExchangeAPI:
    DLPackExchangeAPIHeader header
    void* managed_tensor_allocator
    void* managed_tensor_from_py_object_no_sync
    void* managed_tensor_to_py_object_no_sync
    DLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync
    void* current_work_stream
