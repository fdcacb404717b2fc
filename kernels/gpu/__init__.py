"""GPU kernels of the kvq ops: an empty slot.

No GPU kernel exists yet, so CUDA tensors run the reference kernels (`kvq_ao.kernels.reference`),
which inductor traces and fuses under torch.compile. A GPU kernel belongs here, registered like the
CPU one (`kvq_ao.kernels.cpu`): an implementation of `kvq::decode_attention` for the CUDA dispatch
key (a Triton kernel through `torch.library.register_kernel("kvq::decode_attention", "cuda")`, or a
C++/CUDA `TORCH_LIBRARY_IMPL(kvq, CUDA, m)`), and `kvq_ao.kernels.native_device` answering True for
"cuda" once it is loaded, so that inductor calls it instead of fusing the reference. It must be
checked against the reference on CPU too (Triton kernels under `TRITON_INTERPRET=1`).
"""

__all__: list[str] = []
