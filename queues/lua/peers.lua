--[[ peers: the other workers that could take a newcomer now (in the idle set, said since
`since`), each with the prefix affinity keys it advertises and the head it holds back for memory,
in one round trip. It only reads. The worker hashes are named from `worker_prefix` (Keys.worker
of an empty id): they carry the idle set's hash tag, so on Redis Cluster they live in its slot.
KEYS: idle zset
ARGV: since (ms), worker hash prefix, the asking worker's id (left out)
Returns a flat list: worker id, prefixes, waits_for_memory, for each (a field the hash lacks: nil). ]]
local idle = KEYS[1]
local since, worker_prefix, self_id = ARGV[1], ARGV[2], ARGV[3]

local peers = {}
for _, worker in ipairs(redis.call('ZRANGEBYSCORE', idle, since, '+inf')) do
  if worker ~= self_id then
    local h = redis.call('HMGET', worker_prefix .. worker, 'prefixes', 'waits_for_memory')
    peers[#peers + 1] = worker
    peers[#peers + 1] = h[1]
    peers[#peers + 1] = h[2]
  end
end
return peers
