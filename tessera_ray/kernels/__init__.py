"""MLA decode over paged blocks: a PyTorch reference and FlashMLA / FlashInfer adapters."""
