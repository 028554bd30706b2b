"""numaov.exporter"""
