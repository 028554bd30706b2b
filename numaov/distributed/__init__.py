"""numaov.distributed"""
