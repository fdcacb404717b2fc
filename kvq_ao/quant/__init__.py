
__all__: list[str] = []  # numerics modules: import kvq_ao.quant.<module>
