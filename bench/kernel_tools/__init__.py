"""peerline.bench.kernel_tools"""
