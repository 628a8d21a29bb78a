"""`python -m decode_worker --model DIR --etcd HOST:PORT --pool-master ... --pool-metadata ...`"""

from worker.main import main

if __name__ == "__main__":
    main("decode")
